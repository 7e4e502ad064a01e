"""Public ops over paged and cyclic views."""
from .reference import (
    cyclic_append_reference,
    cyclic_attention_reference,
    paged_append_reference,
    paged_attention_reference,
)

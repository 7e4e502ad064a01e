"""``ninfer-kv generate`` and ``ninfer-kv demo --model DIR`` on tiny checkpoints written here; the
tokenizer (``tokenizers``, the ``hf`` extra) and EOS from ``generation_config.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_fixtures import FAMILY_CONFIGS, random_tensors, write_checkpoint
from ninfer_kv.cli import main
from ninfer_kv.models.generate import PagedGenerator
from ninfer_kv.models.hf import StreamDecoder, eos_token_ids, load_checkpoint, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ["hello world, the paged cache serves tokens", "héllo wörld ✓ ünïcode ok"]


def _tokenizer(path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer needs the 'hf' extra (pip install '.[hf]')")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = dict(FAMILY_CONFIGS["qwen3"], vocab_size=320, eos_token_id=[5, 6])
    return write_checkpoint(tmp_path_factory.mktemp("qwen3"), cfg, random_tensors(cfg, seed=3, dtype="BF16"))


def test_eos_comes_from_generation_config_before_config(tmp_path, checkpoint):
    model = load_checkpoint(checkpoint)
    assert eos_token_ids(checkpoint, model.info.eos_token_ids) == (5, 6)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(tmp_path, model.info.eos_token_ids) == (9,)


def test_generate_streams_token_ids_and_stops_at_eos(checkpoint, capsys):
    model = load_checkpoint(checkpoint)
    prompt = [7, 8, 9, 10, 11]
    free = PagedGenerator(model.params, model.config, max_context=64, max_batch=1).generate([prompt], max_new_tokens=12)[0]
    assert main(["generate", "--model", str(checkpoint), "--prompt", "7 8 9 10 11", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr()
    streamed = [int(x) for x in out.out.split()]
    assert streamed == free.generated and "finish: length" in out.err
    # the EOS id written in generation_config.json stops the command; the EOS itself is not printed
    eos = free.generated[4]
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    try:
        assert main(["generate", "--model", str(checkpoint), "--prompt", "7,8,9,10,11", "--max-new-tokens", "12",
                     "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
    finally:
        (checkpoint / "generation_config.json").unlink()
    cut = free.generated.index(eos)
    assert doc["finish_reason"] == "stop" and doc["tokens"] == free.generated[: cut + 1]
    assert doc["eos_token_ids"] == [eos]


def test_generate_sampling_is_reproducible_and_seeded(checkpoint, capsys):
    argv = ["generate", "--model", str(checkpoint), "--prompt", "1 2 3", "--max-new-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "7", "--kv-cache-dtype", "int8", "--json"]
    runs = []
    for seed in ("7", "7", "8"):
        argv[argv.index("--seed") + 1] = seed
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1] != runs[2]


def test_generate_refuses_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    cases = [
        (["--prompt", "1 two 3"], "'two' is not a token id"),
        (["--prompt", "1 2 999"], "999 is outside the vocabulary [0, 320)"),
        (["--prompt", "1 2", "--top-p", "0"], "--top-p"),
        (["--prompt", "1 2", "--temperature", "-1"], "--temperature"),
        (["--prompt", "1 2", "--impl", "cuda"], "impl 'cuda' is not registered; allowed: auto, reference, pallas, ffi, "
                                                "pallas_tpu"),
    ]
    for extra, match in cases:
        assert main(["generate", "--model", str(checkpoint), *extra]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(FAMILY_CONFIGS["llama"], hidden_act="gelu_new")))
    assert main(["generate", "--model", str(bad), "--prompt", "1 2"]) == 2
    assert "hidden_act='gelu_new' is not supported" in capsys.readouterr().err


def test_text_prompts_stream_text(tmp_path):
    cfg = dict(FAMILY_CONFIGS["llama"], vocab_size=320)
    ck = write_checkpoint(tmp_path / "llama", cfg, random_tensors(cfg, seed=4, dtype="BF16"))
    _tokenizer(ck / "tokenizer.json")
    tok = load_tokenizer(ck)
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    dec = StreamDecoder(tok)
    text = "".join(dec.push(i) for i in tok.encode("héllo wörld ✓")) + dec.flush()
    assert text == "héllo wörld ✓"  # multi-byte characters split over byte-level tokens come out whole
    env_cmd = [sys.executable, "-m", "ninfer_kv", "generate", "--model", str(ck), "--prompt", "hello world",
               "--max-new-tokens", "6", "--json"]
    proc = subprocess.run(env_cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["prompt_tokens"] == ids and len(doc["tokens"]) == 6
    assert doc["text"] == tok.decode(doc["tokens"])


def test_demo_serves_a_checkpoint_and_stops_at_eos(tmp_path, capsys):
    cfg = dict(FAMILY_CONFIGS["mistral"])
    tensors = random_tensors(cfg, seed=8, dtype="F32")
    ck = write_checkpoint(tmp_path / "m", cfg, tensors)
    argv = ["demo", "--model", str(ck), "--requests", "6", "--max-new-tokens", "12", "--system-prompts", "1",
            "--no-progress", "--json"]
    assert main(argv) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["dense_match"] and free["finish_reasons"] == {"length": 6} and free["prefix_hits"] >= 1
    # the most frequent generated token becomes the EOS: requests that produce it end there
    from ninfer_kv.demo.config import DemoConfig
    from ninfer_kv.demo.run import run_demo
    from ninfer_kv.demo.requests import WorkloadSpec

    config = DemoConfig(workload=WorkloadSpec(requests=6, max_new_tokens=12, system_prompts=1), model=str(ck),
                        dense_check=False)
    records = run_demo(config, progress=False).records
    counts = np.bincount(np.concatenate([r.generated for r in records]))
    eos = int(np.argmax(counts))
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert main([*argv[:2], str(ck), *argv[3:]]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["finish_reasons"].get("stop", 0) >= 1 and stopped["dense_match"]
    assert stopped["generated_tokens"] < free["generated_tokens"]
    assert main(["demo", "--model", str(ck), "--speculative", "mtp", "--no-progress"]) == 2
    assert "checkpoint directory" in capsys.readouterr().err


def test_generate_bounds_its_numbers_and_the_model_path_before_allocating(checkpoint, tmp_path, capsys):
    """Each refusal is one line naming the flag, the value and the limit, before any weight or KV page."""
    huge = tmp_path / "huge"  # config.json only: every refusal below comes before the weights are read
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps(dict(FAMILY_CONFIGS["llama"], num_hidden_layers=64,
                                                      max_position_embeddings=2**31 - 64)))
    missing, a_file = tmp_path / "missing", checkpoint / "config.json"
    cases = [
        ([missing, "hi"], [], f"--model {missing}: no such directory"),  # before the prompt is parsed
        ([a_file, "hi"], [], f"--model {a_file}: is a file, not a directory"),
        ([checkpoint, "1 2"], ["--max-context", "1000000000"], "--max-context 1000000000 exceeds the model's context: "
         f"max_position_embeddings=4096 in {checkpoint}/config.json (allowed: at most 4096)"),
        ([checkpoint, "1 2"], ["--max-context", "10000000000"],
         "argument --max-context: 10000000000 is out of range; it must be an integer in [1, 2147483584]"),
        ([checkpoint, "1 2"], ["--max-new-tokens", "3000000000"],
         "argument --max-new-tokens: 3000000000 is out of range; it must be an integer in [1, 2147483584]"),
        ([checkpoint, "1 2"], ["--max-new-tokens", "0"], "argument --max-new-tokens: 0 is out of range"),
        ([checkpoint, " ".join(["1"] * 4096)], [], "--prompt has 4096 tokens; the model's context "
         "(max_position_embeddings=4096) leaves no room to generate (allowed: at most 4095 tokens)"),
        ([huge, "1 2"], ["--max-new-tokens", "2000000000"],
         "--max-new-tokens 2000000000 (a context of 2000000002 tokens): the KV cache needs"),
        ([huge, "1 2"], ["--max-context", "2000000000"], "--max-context 2000000000: the KV cache needs"),
    ]
    bad_eos = tmp_path / "bad_eos"  # a generation_config.json EOS beyond the vocabulary of 320
    bad_eos.mkdir()
    (bad_eos / "config.json").write_text((checkpoint / "config.json").read_text())
    (bad_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 320]}))
    cases.append(([bad_eos, "1 2"], [], f"{bad_eos}/generation_config.json: eos_token_id"))
    for (model, prompt), extra, match in cases:
        assert main(["generate", "--model", str(model), "--prompt", prompt, *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("ninfer-kv generate: error: ") and err.count("\n") == 1, err
        assert match in err, (match, err)

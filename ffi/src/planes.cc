#include "planes.h"

#include <sstream>

NINFER_KV_NAMESPACE_BEGIN
namespace ffi = xla::ffi;

namespace {

// Generated from the codec table (NINFER_KV_CODECS in common.h).
const char* CodecName(Codec c) { return InfoOf(c).name; }

// The head-dim rule in words, from the table: "INT8-G64 needs a multiple of 64, NVFP4-G16 a
// multiple of 16" (the codecs whose multiple is not 1).
std::string HeadDimRule() {
  std::string rule;
  for (const CodecInfo& info : kCodecInfo) {
    if (info.head_dim_multiple == 1) continue;
    rule += rule.empty() ? std::string(info.label) + " needs" : std::string(", ") + info.label;
    rule += " a multiple of " + std::to_string(info.head_dim_multiple);
  }
  return rule;
}

// The storage dtypes of each codec, indexed by codec id (the table's row order).
#define NINFER_KV_CODEC_DATA(e, id, name, label, data, ...) ffi::DataType::data,
#define NINFER_KV_CODEC_SCALE(e, id, name, label, data, data_bytes, pack, scale, ...) ffi::DataType::scale,
constexpr ffi::DataType kDataDtype[] = {NINFER_KV_CODECS(NINFER_KV_CODEC_DATA)};
constexpr ffi::DataType kScaleDtype[] = {NINFER_KV_CODECS(NINFER_KV_CODEC_SCALE)};
#undef NINFER_KV_CODEC_DATA
#undef NINFER_KV_CODEC_SCALE

ffi::DataType DataDtype(Codec c) { return kDataDtype[static_cast<int32_t>(c)]; }
ffi::DataType ScaleDtype(Codec c) { return kScaleDtype[static_cast<int32_t>(c)]; }

ffi::Error CheckPlane(const ffi::AnyBuffer& buf, const char* name, ffi::DataType dtype, int64_t extent,
                      const int64_t* lead, Codec codec) {
  auto dims = buf.dimensions();
  if (dims.size() != 5) {
    return ffi::Error::InvalidArgument(std::string("plane ") + name + " must be rank 5 (layer axis first), got shape " +
                                       DimsString(dims));
  }
  if (buf.element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string("plane ") + name + " has the wrong dtype for codec " +
                                       CodecName(codec));
  }
  if (dims[4] != extent) {
    std::ostringstream os;
    os << "plane " << name << " has extent " << dims[4] << " in its last axis; codec " << CodecName(codec)
       << " needs " << extent;
    return ffi::Error::InvalidArgument(os.str());
  }
  for (int i = 0; i < 4; ++i) {
    if (dims[i] != lead[i]) {
      return ffi::Error::InvalidArgument(std::string("plane ") + name + " has shape " + DimsString(dims) +
                                         "; its leading four dims must match plane k's");
    }
  }
  return ffi::Error::Success();
}

}  // namespace

std::string DimsString(ffi::AnyBuffer::Dimensions dims) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << (dims.size() == 1 ? ",)" : ")");
  return os.str();
}

ffi::Error ParsePlanes(const std::vector<ffi::AnyBuffer>& planes, int32_t k_codec, int32_t v_codec, int d,
                       PlaneSet* out) {
  if (!ValidCodec(k_codec) || !ValidCodec(v_codec)) {
    std::ostringstream os;
    os << "k_codec and v_codec must be in [0, " << kNumCodecs - 1 << "] (";
    for (int32_t i = 0; i < kNumCodecs; ++i) os << (i ? ", " : "") << kCodecInfo[i].name;
    os << ")";
    return ffi::Error::InvalidArgument(os.str());
  }
  const Codec kc = static_cast<Codec>(k_codec), vc = static_cast<Codec>(v_codec);
  if (!HeadDimSupported(kc, d) || !HeadDimSupported(vc, d)) {
    std::ostringstream os;
    os << "head_dim=" << d << " is not supported by codecs " << CodecName(kc) << " / " << CodecName(vc)
       << " (" << HeadDimRule() << ")";
    return ffi::Error::InvalidArgument(os.str());
  }
  const size_t want = static_cast<size_t>(NumPlanes(kc) + NumPlanes(vc));
  if (planes.size() != want) {
    std::ostringstream os;
    os << "expected " << want << " planes (k, [k_scale], v, [v_scale]) for codecs " << CodecName(kc) << " / "
       << CodecName(vc) << ", got " << planes.size();
    return ffi::Error::InvalidArgument(os.str());
  }
  auto kd = planes[0].dimensions();
  if (kd.size() != 5) {
    return ffi::Error::InvalidArgument("plane k must be rank 5 (layer axis first), got shape " + DimsString(kd));
  }
  for (int i = 0; i < 4; ++i) out->dims[i] = kd[i];
  for (int i = 0; i < 4; ++i) {
    if (out->dims[i] <= 0) return ffi::Error::InvalidArgument("plane k has an empty axis: " + DimsString(kd));
  }
  out->k_codec = kc;
  out->v_codec = vc;
  out->head_dim = d;
  size_t idx = 0;
  for (int tensor = 0; tensor < 2; ++tensor) {
    const Codec c = tensor == 0 ? kc : vc;
    const CodecPlanes cp = PlanesOf(c, d);
    const char* dname = tensor == 0 ? "k" : "v";
    const char* sname = tensor == 0 ? "k_scale" : "v_scale";
    const ffi::AnyBuffer& data = planes[idx++];
    if (auto err = CheckPlane(data, dname, DataDtype(c), cp.data_extent, out->dims, c); !err.success()) return err;
    uint8_t* data_ptr = static_cast<uint8_t*>(data.untyped_data());
    uint8_t* scale_ptr = nullptr;
    if (cp.scale_extent > 0) {
      const ffi::AnyBuffer& scale = planes[idx++];
      if (auto err = CheckPlane(scale, sname, ScaleDtype(c), cp.scale_extent, out->dims, c); !err.success()) return err;
      scale_ptr = static_cast<uint8_t*>(scale.untyped_data());
    }
    const int64_t data_bytes = static_cast<int64_t>(cp.data_extent) * cp.data_itemsize;
    const int64_t scale_bytes = static_cast<int64_t>(cp.scale_extent) * cp.scale_itemsize;
    if (tensor == 0) {
      out->k_data = data_ptr;
      out->k_scale = scale_ptr;
      out->token_bytes.k_data = data_bytes;
      out->token_bytes.k_scale = scale_bytes;
    } else {
      out->v_data = data_ptr;
      out->v_scale = scale_ptr;
      out->token_bytes.v_data = data_bytes;
      out->token_bytes.v_scale = scale_bytes;
    }
  }
  return ffi::Error::Success();
}

ffi::Error CollectArgs(const ffi::RemainingArgs& args, std::vector<ffi::AnyBuffer>* out) {
  out->clear();
  for (size_t i = 0; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return ffi::Error::InvalidArgument("plane operand " + std::to_string(i) + " is not a buffer");
    out->push_back(*buf);
  }
  return ffi::Error::Success();
}

ffi::Error CollectRets(const ffi::RemainingRets& rets, std::vector<ffi::AnyBuffer>* out) {
  out->clear();
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return ffi::Error::InvalidArgument("plane result " + std::to_string(i) + " is not a buffer");
    out->push_back(**buf);
  }
  return ffi::Error::Success();
}

NINFER_KV_NAMESPACE_END

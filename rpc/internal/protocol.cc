#include "rpc/internal/protocol.h"

#include "comm/exception_status.h"
#include "rpc/functions.h"

namespace dtrain::rpc::protocol {
namespace {

constexpr int64_t kMaxOptions = 1024;

// Runs `read` (which returns a T) over a received message: any exception it throws (CodecError
// from the bounded readers, mostly) becomes a Status with `code`.
template <typename T, typename F>
absl::StatusOr<T> decoding(absl::StatusCode code, F&& read) {
  try {
    return read();
  } catch (...) {
    return comm::current_exception_status(code);
  }
}

constexpr absl::StatusCode kRequest = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kReply = absl::StatusCode::kDataLoss;

void expect_tensors(const std::vector<at::Tensor>& tensors, size_t n) {
  if (tensors.size() != n) throw CodecError(absl::StrCat(tensors.size(), " tensors, expected ", n));
}

}  // namespace

absl::StatusOr<Done> Done::decode(Response& r) {
  return decoding<Done>(kReply, [&] {
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return Done{};
  });
}

Encoded ParamCreate::encode() const { return Encoded{Writer(), {value}}; }

absl::StatusOr<ParamCreate> ParamCreate::decode(Request& r) {
  return decoding<ParamCreate>(kRequest, [&] {
    r.body.expect_done();
    if (r.tensors.size() != 1)
      throw CodecError(absl::StrCat(kName, " takes one tensor, got ", r.tensors.size()));
    return ParamCreate{std::move(r.tensors[0])};
  });
}

Reply ParamCreate::Result::encode() const { return Reply{Writer().i64(id), {}}; }

absl::StatusOr<ParamCreate::Result> ParamCreate::Result::decode(Response& r) {
  return decoding<Result>(kReply, [&] {
    Result out{r.body.i64()};
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return out;
  });
}

Encoded ParamFetch::encode() const { return Encoded{Writer().i64(id), {}}; }

absl::StatusOr<ParamFetch> ParamFetch::decode(Request& r) {
  return decoding<ParamFetch>(kRequest, [&] {
    ParamFetch m{r.body.i64()};
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return m;
  });
}

Reply ParamFetch::Result::encode() const { return Reply{Writer(), {value}}; }

absl::StatusOr<ParamFetch::Result> ParamFetch::Result::decode(Response& r) {
  return decoding<Result>(kReply, [&] {
    r.body.expect_done();
    expect_tensors(r.tensors, 1);
    return Result{std::move(r.tensors[0])};
  });
}

Encoded GradPush::encode() const { return Encoded{Writer().i64(context).i64_list(ids), grads}; }

absl::StatusOr<GradPush> GradPush::decode(Request& r) {
  return decoding<GradPush>(kRequest, [&] {
    GradPush m;
    m.context = r.body.i64();
    m.ids = r.body.i64_list();
    r.body.expect_done();
    if (m.ids.size() != r.tensors.size()) {
      throw CodecError(absl::StrCat(kName, ": ", m.ids.size(), " parameter ids but ",
                                    r.tensors.size(), " gradients"));
    }
    m.grads = std::move(r.tensors);
    return m;
  });
}

Encoded GradRelease::encode() const { return Encoded{Writer().i64(context), {}}; }

absl::StatusOr<GradRelease> GradRelease::decode(Request& r) {
  return decoding<GradRelease>(kRequest, [&] {
    GradRelease m{r.body.i64()};
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return m;
  });
}

Encoded FnRemote::encode() const {
  Encoded e;
  e.body.str(fn);
  write_args(e.body, e.tensors, args);
  return e;
}

absl::StatusOr<FnRemote> FnRemote::decode(Request& r) {
  return decoding<FnRemote>(kRequest, [&] {
    FnRemote m;
    m.fn = r.body.str();
    m.args = read_args(r.body, r.tensors);
    r.body.expect_done();
    return m;
  });
}

Encoded OptimCreate::encode() const {
  Encoded e;
  e.body.str(key).str(optimizer);
  write_options(e.body, options);
  e.body.i64_list(ids);
  return e;
}

absl::StatusOr<OptimCreate> OptimCreate::decode(Request& r) {
  return decoding<OptimCreate>(kRequest, [&] {
    OptimCreate m;
    m.key = r.body.str();
    m.optimizer = r.body.str();
    m.options = read_options(r.body);
    m.ids = r.body.i64_list();
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return m;
  });
}

Encoded OptimStep::encode() const { return Encoded{Writer().str(key).i64(context), {}}; }

absl::StatusOr<OptimStep> OptimStep::decode(Request& r) {
  return decoding<OptimStep>(kRequest, [&] {
    OptimStep m;
    m.key = r.body.str();
    m.context = r.body.i64();
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return m;
  });
}

Reply OptimStep::Result::encode() const { return Reply{Writer().boolean(stepped), {}}; }

absl::StatusOr<OptimStep::Result> OptimStep::Result::decode(Response& r) {
  return decoding<Result>(kReply, [&] {
    Result out{r.body.boolean()};
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return out;
  });
}

Encoded OptimDestroy::encode() const { return Encoded{Writer().str(key), {}}; }

absl::StatusOr<OptimDestroy> OptimDestroy::decode(Request& r) {
  return decoding<OptimDestroy>(kRequest, [&] {
    OptimDestroy m{r.body.str()};
    r.body.expect_done();
    expect_tensors(r.tensors, 0);
    return m;
  });
}

void write_options(Writer& w, const optim::OptionsDict& options) {
  std::vector<std::pair<std::string, c10::IValue>> items;
  for (const auto& kv : options) {
    if (!kv.value().isNone()) items.emplace_back(kv.key().toStringRef(), kv.value());
  }
  w.i64(static_cast<int64_t>(items.size()));
  for (const auto& [key, v] : items) {
    w.str(key);
    if (v.isDouble()) {
      w.f64(v.toDouble());
    } else if (v.isBool()) {
      w.boolean(v.toBool());
    } else if (v.isInt()) {
      w.i64(v.toInt());
    } else if (v.isString()) {
      w.str(v.toStringRef());
    } else if (v.isTuple() || v.isList() || v.isDoubleList()) {
      std::vector<double> xs;
      const auto elements = v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec();
      for (const auto& e : elements) xs.push_back(e.toScalar().toDouble());
      w.f64_list(xs);
    } else {
      TORCH_CHECK(false, "optimizer option '", key, "' has a type (", v.tagKind(),
                  ") that cannot travel: use numbers, booleans, strings or pairs of numbers");
    }
  }
}

optim::OptionsDict read_options(Reader& r) {
  optim::OptionsDict d = optim::new_options_dict();
  const int64_t n = r.i64();
  if (n < 0 || n > kMaxOptions) throw CodecError(absl::StrCat("option count ", n, " out of range"));
  for (int64_t i = 0; i < n; ++i) {
    const std::string key = r.str();
    switch (r.peek_tag()) {
      case Reader::kF64:
        d.insert(key, r.f64());
        break;
      case Reader::kBool:
        d.insert(key, r.boolean());
        break;
      case Reader::kI64:
        d.insert(key, r.i64());
        break;
      case Reader::kStr:
        d.insert(key, r.str());
        break;
      case Reader::kF64List: {
        std::vector<c10::IValue> xs;
        for (double x : r.f64_list()) xs.emplace_back(x);
        d.insert(key, c10::ivalue::Tuple::create(std::move(xs)));
        break;
      }
      default:
        throw CodecError(absl::StrCat("option '", key, "' has an unsupported value tag"));
    }
  }
  return d;
}

}  // namespace dtrain::rpc::protocol

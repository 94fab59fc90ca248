// Writing DCP's .metadata (dcp_metadata.h): a protocol-2 pickle of DCP's dataclasses, as
// Python's pickler spells them (NEWOBJ with no arguments, then BUILD with the instance's state),
// without a memo: every value is written where it is used.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <variant>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/internal/dcp_dtypes.h"

namespace dtrain::checkpoint {
namespace {

constexpr char kMetadataModule[] = "torch.distributed.checkpoint.metadata";

const char* dtype_name(at::ScalarType t) {
  const char* name = internal::dcp_dtype_name(t);
  TORCH_CHECK(name != nullptr, "write_dcp_metadata: dtype ", t, " is not one DCP files hold");
  return name;
}

class Pickler {
 public:
  Pickler() { out_ = "\x80\x02"; }  // PROTO 2
  std::string finish() {
    out_.push_back('.');
    return std::move(out_);
  }

  void global(const char* module, const char* name) {
    out_.push_back('c');
    out_ += module;
    out_.push_back('\n');
    out_ += name;
    out_.push_back('\n');
  }
  void str(const std::string& s) {  // BINUNICODE
    out_.push_back('X');
    u32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {  // BININT
      out_.push_back('J');
      u32(static_cast<uint32_t>(static_cast<int32_t>(v)));
      return;
    }
    out_ += "\x8a\x08";  // LONG1, 8 bytes
    for (int i = 0; i < 8; ++i)
      out_.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
  }
  void none() { out_.push_back('N'); }
  void boolean(bool b) { out_.push_back(b ? '\x88' : '\x89'); }
  void mark() { out_.push_back('('); }
  void tuple() { out_.push_back('t'); }
  void empty_dict() { out_.push_back('}'); }
  void empty_list() { out_.push_back(']'); }
  void setitems() { out_.push_back('u'); }
  void appends() { out_.push_back('e'); }
  void reduce() { out_.push_back('R'); }
  // NEWOBJ of module.cls with no arguments; the caller writes the state dict and calls build().
  void new_object(const char* module, const char* cls) {
    global(module, cls);
    out_.push_back(')');
    out_.push_back('\x81');
  }
  void build() { out_.push_back('b'); }

  void size(const std::vector<int64_t>& dims) {  // torch.Size((d0, d1, ...))
    global("torch", "Size");
    mark();
    mark();
    for (int64_t d : dims) integer(d);
    tuple();
    tuple();
    reduce();
  }

 private:
  void u32(uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

void storage_info(Pickler& p, const DcpStorage& s) {
  p.new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
  p.empty_dict();
  p.mark();
  p.str("relative_path");
  p.str(s.relative_path);
  p.str("offset");
  p.integer(s.offset);
  p.str("length");
  p.integer(s.length);
  p.setitems();
  p.build();
}

void metadata_index(Pickler& p, const std::string& key, const std::vector<int64_t>* offsets) {
  p.new_object(kMetadataModule, "MetadataIndex");
  p.empty_dict();
  p.mark();
  p.str("fqn");
  p.str(key);
  p.str("offset");
  if (offsets != nullptr) {
    p.size(*offsets);
  } else {
    p.none();
  }
  p.str("index");
  p.none();
  p.setitems();
  p.build();
}

void tensor_metadata(Pickler& p, const DcpTensor& t) {
  p.new_object(kMetadataModule, "TensorStorageMetadata");
  p.empty_dict();
  p.mark();
  p.str("properties");
  p.new_object(kMetadataModule, "TensorProperties");
  p.mark();
  p.global("torch", dtype_name(t.dtype));
  p.global("torch.serialization", "_get_layout");
  p.mark();
  p.str("torch.strided");
  p.tuple();
  p.reduce();
  p.boolean(t.requires_grad);
  p.global(kMetadataModule, "_MEM_FORMAT_ENCODING");
  p.mark();
  p.integer(0);  // TORCH_CONTIGUOUS_FORMAT
  p.tuple();
  p.reduce();
  p.boolean(false);  // pin_memory
  p.tuple();
  p.build();
  p.str("size");
  p.size(t.size);
  p.str("chunks");
  p.empty_list();
  p.mark();
  for (const DcpChunk& c : t.chunks) {
    p.new_object(kMetadataModule, "ChunkStorageMetadata");
    p.empty_dict();
    p.mark();
    p.str("offsets");
    p.size(c.offsets);
    p.str("sizes");
    p.size(c.sizes);
    p.setitems();
    p.build();
  }
  p.appends();
  p.setitems();
  p.build();
}

void path(Pickler& p, const std::string& key, const DcpPath* given) {
  p.mark();
  if (given != nullptr) {
    for (const auto& part : *given) {
      if (const std::string* s = std::get_if<std::string>(&part)) {
        p.str(*s);
      } else {
        p.integer(std::get<int64_t>(part));
      }
    }
  } else {
    size_t start = 0;
    while (true) {
      const size_t dot = key.find('.', start);
      p.str(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
  }
  p.tuple();
}

}  // namespace

std::string write_dcp_metadata(const DcpMetadata& metadata) {
  Pickler p;
  p.new_object(kMetadataModule, "Metadata");
  p.empty_dict();
  p.mark();
  p.str("state_dict_metadata");
  p.empty_dict();
  p.mark();
  for (const auto& [key, t] : metadata.tensors) {
    p.str(key);
    tensor_metadata(p, t);
  }
  for (const auto& [key, s] : metadata.objects) {
    TORCH_CHECK(metadata.tensors.count(key) == 0, "write_dcp_metadata: '", key,
                "' is both a tensor and bytes");
    p.str(key);
    p.new_object(kMetadataModule, "BytesStorageMetadata");
  }
  p.setitems();
  p.str("planner_data");
  p.empty_dict();
  p.mark();
  for (const auto* keys : {&metadata.tensors}) {
    for (const auto& kv : *keys) {
      p.str(kv.first);
      auto it = metadata.paths.find(kv.first);
      path(p, kv.first, it == metadata.paths.end() ? nullptr : &it->second);
    }
  }
  for (const auto& kv : metadata.objects) {
    p.str(kv.first);
    auto it = metadata.paths.find(kv.first);
    path(p, kv.first, it == metadata.paths.end() ? nullptr : &it->second);
  }
  p.setitems();
  p.str("storage_data");
  p.empty_dict();
  p.mark();
  for (const auto& [key, t] : metadata.tensors) {
    for (const DcpChunk& c : t.chunks) {
      metadata_index(p, key, &c.offsets);
      storage_info(p, c.storage);
    }
  }
  for (const auto& [key, s] : metadata.objects) {
    metadata_index(p, key, nullptr);
    storage_info(p, s);
  }
  p.setitems();
  p.str("storage_meta");
  p.new_object(kMetadataModule, "StorageMeta");
  p.empty_dict();
  p.mark();
  p.str("checkpoint_id");
  p.none();
  p.str("save_id");
  p.str(metadata.save_id);
  p.str("load_id");
  p.none();
  p.str("modules");
  p.empty_list();
  p.setitems();
  p.build();
  p.str("version");
  p.str(metadata.version.empty() ? "1.0.0" : metadata.version);
  p.setitems();
  p.build();
  return p.finish();
}

}  // namespace dtrain::checkpoint

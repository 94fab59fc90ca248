// Reading and checking DCP's .metadata (dcp_metadata.h); the writer is dcp_metadata_writer.cc.
#include "checkpoint/dcp_metadata.h"

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/internal/dcp_dtypes.h"
#include "checkpoint/pickle_reader.h"

namespace dtrain::checkpoint {
namespace {

constexpr char kIndexPrefix[] = "\x01MetadataIndex\x01";

// Pairwise chunk comparisons allowed per file: far beyond any checkpoint a job writes (one chunk
// per rank per tensor), small enough that a hostile file cannot take minutes.
constexpr int64_t kMaxComparisons = int64_t{50} * 1000 * 1000;

std::string printable(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 200)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  return out;
}

class Decoder {
 public:
  explicit Decoder(const std::string& name) : name_(name) {}

  absl::Status bad(const std::string& what) const {
    return absl::DataLossError(absl::StrCat(name_, "'s .metadata is damaged: ", what));
  }
  absl::Status unsupported(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, "'s .metadata: ", what));
  }

  // The object `v` of class `cls` ("Metadata"), its fields.
  absl::StatusOr<c10::impl::GenericDict> object(const c10::IValue& v, const char* cls,
                                                const std::string& where) const {
    if (!v.isGenericDict()) return bad(absl::StrCat(where, " is not a ", cls));
    c10::impl::GenericDict d = v.toGenericDict();
    auto it = d.find("__class__");
    if (it == d.end() || !it->value().isString() || it->value().toStringRef() != cls)
      return bad(absl::StrCat(where, " is not a ", cls));
    return d;
  }
  static c10::IValue field(const c10::impl::GenericDict& d, const char* name) {
    auto it = d.find(name);
    return it == d.end() ? c10::IValue() : it->value();
  }
  absl::StatusOr<std::vector<int64_t>> size(const c10::IValue& v, const std::string& where) const {
    if (!v.isTuple()) return bad(absl::StrCat(where, " is not a torch.Size"));
    std::vector<int64_t> out;
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      if (!e.isInt() || e.toInt() < 0)
        return bad(absl::StrCat(where, " holds a negative or non-int"));
      out.push_back(e.toInt());
    }
    return out;
  }

  absl::StatusOr<DcpMetadata> decode(const c10::IValue& root) {
    absl::StatusOr<c10::impl::GenericDict> md = object(root, "Metadata", "the pickled value");
    if (!md.ok()) return md.status();
    DcpMetadata out;
    if (const c10::IValue v = field(*md, "version"); v.isString()) {
      out.version = v.toStringRef();
    } else if (!v.isNone()) {
      return bad("version is not a str");
    }
    if (out.version != "" && out.version != "1.0.0") {
      return unsupported(absl::StrCat("version '", printable(out.version),
                                      "' is newer than dtrain reads (1.0.0); save with PyTorch "
                                      "2.6-2.15 or update dtrain"));
    }
    if (absl::Status s = storage_meta(field(*md, "storage_meta"), &out); !s.ok()) return s;
    const c10::IValue sdm = field(*md, "state_dict_metadata");
    const c10::IValue storage = field(*md, "storage_data");
    if (!sdm.isGenericDict()) return bad("state_dict_metadata is not a dict");
    if (!storage.isGenericDict()) return bad("storage_data is not a dict");
    std::map<std::string, DcpStorage> stores;  // by the MetadataIndex key (pickle_reader.h)
    for (const auto& kv : storage.toGenericDict()) {
      if (!kv.key().isString() || !absl::StartsWith(kv.key().toStringRef(), kIndexPrefix))
        return bad("a storage_data key is not a MetadataIndex");
      const std::string& k = kv.key().toStringRef();
      const size_t sep = k.find('\x01', sizeof(kIndexPrefix) - 1);
      if (sep == std::string::npos) return bad("a storage_data key is not a MetadataIndex");
      absl::StatusOr<DcpStorage> s = storage_info(kv.value(), k.substr(sep + 1));
      if (!s.ok()) return s.status();
      stores.emplace(k, *s);
    }
    std::set<const DcpStorage*> used;
    for (const auto& kv : sdm.toGenericDict()) {
      if (!kv.key().isString()) return bad("a state_dict_metadata key is not a str");
      const std::string& key = kv.key().toStringRef();
      absl::Status s = entry(key, kv.value(), stores, &used, &out);
      if (!s.ok()) return s;
    }
    if (used.size() != stores.size()) {
      return bad(absl::StrCat("storage_data has ", stores.size() - used.size(),
                              " entries for no key or chunk of state_dict_metadata"));
    }
    return planner_data(field(*md, "planner_data"), &out) ? absl::StatusOr<DcpMetadata>(out)
                                                          : bad("planner_data is malformed");
  }

 private:
  // The storage_data key of `key` at chunk `offsets` (nullptr: a bytes item).
  static std::string index_key(const std::string& key, const std::vector<int64_t>* offsets) {
    std::string k = kIndexPrefix;
    if (offsets == nullptr) {
      k += "None";
    } else {
      for (size_t i = 0; i < offsets->size(); ++i) absl::StrAppend(&k, i ? "," : "", (*offsets)[i]);
    }
    return absl::StrCat(k, "\x01", key);
  }

  absl::Status storage_meta(const c10::IValue& v, DcpMetadata* out) const {
    if (v.isNone()) return absl::OkStatus();
    absl::StatusOr<c10::impl::GenericDict> d = object(v, "StorageMeta", "storage_meta");
    if (!d.ok()) return d.status();
    if (const c10::IValue id = field(*d, "save_id"); id.isString()) {
      out->save_id = id.toStringRef();
    } else if (!id.isNone()) {
      return bad("storage_meta.save_id is not a str");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<DcpStorage> storage_info(const c10::IValue& v, const std::string& key) const {
    const std::string where = absl::StrCat("the storage of '", printable(key), "'");
    absl::StatusOr<c10::impl::GenericDict> d = object(v, "_StorageInfo", where);
    if (!d.ok()) return d.status();
    if (const c10::IValue t = field(*d, "transform_descriptors");
        !t.isNone() && !(t.isList() && t.toListRef().empty()) &&
        !(t.isTuple() && t.toTupleRef().elements().empty())) {
      return unsupported(absl::StrCat(where,
                                      " names storage transforms (compression or another "
                                      "extension of the storage writer), which dtrain does not "
                                      "read; save without them"));
    }
    const c10::IValue path = field(*d, "relative_path");
    const c10::IValue offset = field(*d, "offset");
    const c10::IValue length = field(*d, "length");
    if (!path.isString() || !offset.isInt() || !length.isInt())
      return bad(absl::StrCat(where, " lacks relative_path, offset or length"));
    const std::string& p = path.toStringRef();
    if (p.empty() || p == "." || p == ".." || p.find('/') != std::string::npos ||
        p.find('\\') != std::string::npos || p.find('\0') != std::string::npos) {
      return bad(absl::StrCat(where, " is in '", printable(p),
                              "', which is not a plain file name inside the checkpoint"));
    }
    if (offset.toInt() < 0 || length.toInt() < 0)
      return bad(absl::StrCat(where, " has a negative offset or length"));
    return DcpStorage{p, offset.toInt(), length.toInt()};
  }

  absl::Status entry(const std::string& key, const c10::IValue& v,
                     const std::map<std::string, DcpStorage>& stores,
                     std::set<const DcpStorage*>* used, DcpMetadata* out) {
    const std::string where = absl::StrCat("'", printable(key), "'");
    if (object(v, "BytesStorageMetadata", where).ok()) {
      auto it = stores.find(index_key(key, nullptr));
      if (it == stores.end()) return bad(absl::StrCat(where, " has no storage"));
      used->insert(&it->second);
      out->objects[key] = it->second;
      return absl::OkStatus();
    }
    absl::StatusOr<c10::impl::GenericDict> d = object(v, "TensorStorageMetadata", where);
    if (!d.ok()) return bad(absl::StrCat(where, " is neither a TensorStorageMetadata nor bytes"));
    DcpTensor t;
    if (absl::Status s = properties(field(*d, "properties"), where, &t); !s.ok()) return s;
    absl::StatusOr<std::vector<int64_t>> shape = size(field(*d, "size"), where + "'s size");
    if (!shape.ok()) return shape.status();
    t.size = *shape;
    const c10::IValue chunks = field(*d, "chunks");
    if (!chunks.isList()) return bad(absl::StrCat(where, "'s chunks are not a list"));
    for (const c10::IValue& c : chunks.toListRef()) {
      absl::StatusOr<c10::impl::GenericDict> cd =
          object(c, "ChunkStorageMetadata", where + "'s chunk");
      if (!cd.ok()) return cd.status();
      DcpChunk chunk;
      absl::StatusOr<std::vector<int64_t>> o =
          size(field(*cd, "offsets"), where + "'s chunk offsets");
      if (!o.ok()) return o.status();
      absl::StatusOr<std::vector<int64_t>> z = size(field(*cd, "sizes"), where + "'s chunk sizes");
      if (!z.ok()) return z.status();
      chunk.offsets = *o;
      chunk.sizes = *z;
      auto it = stores.find(index_key(key, &chunk.offsets));
      if (it == stores.end()) return bad(absl::StrCat(where, " has a chunk with no storage"));
      used->insert(&it->second);
      chunk.storage = it->second;
      t.chunks.push_back(std::move(chunk));
    }
    if (absl::Status s = check_cover(t, where); !s.ok()) return s;
    out->tensors[key] = std::move(t);
    return absl::OkStatus();
  }

  absl::Status properties(const c10::IValue& v, const std::string& where, DcpTensor* t) const {
    absl::StatusOr<c10::impl::GenericDict> d =
        object(v, "TensorProperties", where + "'s properties");
    if (!d.ok()) return d.status();
    const c10::IValue state = field(*d, "__state__");
    // (dtype, layout, requires_grad, memory format, pin_memory), and since PyTorch 2.15 the
    // strides of the tensor saved (None or ints; chunks carry their own layout, so unused here).
    const size_t n = state.isTuple() ? state.toTupleRef().elements().size() : 0;
    if (n != 5 && n != 6)
      return bad(absl::StrCat(where, "'s properties are not DCP's 5- or 6-tuple"));
    const auto& e = state.toTupleRef().elements();
    if (n == 6 && !e[5].isNone()) {
      if (!e[5].isTuple()) return bad(absl::StrCat(where, "'s strides are not a tuple"));
      for (const c10::IValue& st : e[5].toTupleRef().elements()) {
        if (!st.isInt()) return bad(absl::StrCat(where, "'s strides are not ints"));
      }
    }
    if (!e[0].isString()) return bad(absl::StrCat(where, "'s dtype is not a torch dtype"));
    const std::string& dtype = e[0].toStringRef();
    std::optional<at::ScalarType> known;
    if (absl::StartsWith(dtype, "torch.")) known = internal::dcp_dtype(dtype.substr(6));
    if (!known.has_value()) return bad(absl::StrCat(where, "'s dtype is not a torch dtype"));
    t->dtype = *known;
    if (!e[1].isString() || e[1].toStringRef() != "torch.strided") {
      return unsupported(absl::StrCat(where,
                                      " is not a strided (dense) tensor; dtrain reads "
                                      "dense tensors"));
    }
    if (!e[2].isBool() || !e[3].isInt() || !e[4].isBool())
      return bad(absl::StrCat(where, "'s properties are malformed"));
    t->requires_grad = e[2].toBool();
    return absl::OkStatus();
  }

  // Every chunk inside the tensor, no two overlapping, their volumes summing to the tensor's:
  // together, an exact cover.
  absl::Status check_cover(const DcpTensor& t, const std::string& where) {
    const size_t rank = t.size.size();
    int64_t numel = 1;
    for (int64_t s : t.size) {
      if (s != 0 && numel > std::numeric_limits<int64_t>::max() / s)
        return bad(absl::StrCat(where, "'s size overflows 64 bits"));
      numel *= s;
    }
    int64_t total = 0;
    for (const DcpChunk& c : t.chunks) {
      if (c.offsets.size() != rank || c.sizes.size() != rank)
        return bad(absl::StrCat(where, " has a chunk of another number of dimensions"));
      for (size_t d = 0; d < rank; ++d) {
        if (c.offsets[d] > t.size[d] || c.sizes[d] > t.size[d] - c.offsets[d])
          return bad(absl::StrCat(where, " has a chunk outside the tensor"));
      }
      const int64_t n = box_numel(c.sizes);  // <= numel: inside the tensor
      if (n > numel - total) {
        total = -1;  // more than the tensor holds
        break;
      }
      total += n;
    }
    if (total != numel) {
      return bad(total < 0 ? absl::StrCat(where, "'s chunks overlap (they hold more than its ",
                                          numel, " elements)")
                           : absl::StrCat(where, "'s chunks leave holes (they hold ", total,
                                          " elements of ", numel, ")"));
    }
    // Sweep along the dimension with the most distinct offsets.
    std::vector<const DcpChunk*> live;
    for (const DcpChunk& c : t.chunks)
      if (box_numel(c.sizes) > 0) live.push_back(&c);
    if (rank == 0 || live.size() < 2) return absl::OkStatus();
    size_t axis = 0;
    size_t best = 0;
    for (size_t d = 0; d < rank; ++d) {
      std::vector<int64_t> starts;
      for (const DcpChunk* c : live) starts.push_back(c->offsets[d]);
      std::sort(starts.begin(), starts.end());
      const size_t distinct =
          static_cast<size_t>(std::unique(starts.begin(), starts.end()) - starts.begin());
      if (distinct > best) best = distinct, axis = d;
    }
    std::sort(live.begin(), live.end(), [axis](const DcpChunk* a, const DcpChunk* b) {
      return a->offsets[axis] < b->offsets[axis];
    });
    for (size_t i = 0; i < live.size(); ++i) {
      for (size_t j = i + 1; j < live.size() &&
                             live[j]->offsets[axis] < live[i]->offsets[axis] + live[i]->sizes[axis];
           ++j) {
        if (++comparisons_ > kMaxComparisons) {
          return unsupported(
              absl::StrCat(where, " has more chunks than dtrain checks (", t.chunks.size(), ")"));
        }
        bool overlap = true;
        for (size_t d = 0; d < rank && overlap; ++d) {
          overlap = live[i]->offsets[d] < live[j]->offsets[d] + live[j]->sizes[d] &&
                    live[j]->offsets[d] < live[i]->offsets[d] + live[i]->sizes[d];
        }
        if (overlap) return bad(absl::StrCat(where, "'s chunks overlap"));
      }
    }
    return absl::OkStatus();
  }

  bool planner_data(const c10::IValue& v, DcpMetadata* out) const {
    if (v.isNone()) return true;
    if (!v.isGenericDict()) return false;
    for (const auto& kv : v.toGenericDict()) {
      if (!kv.key().isString() || !kv.value().isTuple()) return false;
      DcpPath path;
      for (const c10::IValue& part : kv.value().toTupleRef().elements()) {
        if (part.isString()) {
          path.emplace_back(part.toStringRef());
        } else if (part.isInt()) {
          path.emplace_back(part.toInt());
        } else {
          return false;
        }
      }
      out->paths[kv.key().toStringRef()] = std::move(path);
    }
    return true;
  }

  const std::string& name_;
  int64_t comparisons_ = 0;
};

}  // namespace

int64_t box_numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

absl::StatusOr<DcpMetadata> read_dcp_metadata(std::string_view bytes,
                                              const std::string& name_for_errors) {
  const std::string pickle_name = absl::StrCat(name_for_errors, "'s .metadata");
  absl::StatusOr<c10::IValue> v = read_pickle(
      bytes, pickle_name,
      [&](const std::string&, at::ScalarType, int64_t) -> absl::StatusOr<at::Storage> {
        return absl::DataLossError(
            absl::StrCat(pickle_name, " refers to a storage; DCP's metadata holds none"));
      },
      PickleDialect::kDcpMetadata);
  if (!v.ok()) return v.status();
  try {
    return Decoder(name_for_errors).decode(*v);
  } catch (const std::exception& e) {  // a backstop: every access above is checked first
    return absl::DataLossError(absl::StrCat(
        name_for_errors, "'s .metadata cannot be read: ", std::string(e.what()).substr(0, 200)));
  }
}

absl::Status check_dcp_files(const DcpMetadata& metadata,
                             const std::map<std::string, int64_t>& file_sizes,
                             const std::string& name_for_errors) {
  // (file, offset) -> (end, key): sorted per file to find overlaps.
  std::map<std::string, std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>>> spans;
  auto add = [&](const std::string& key, const DcpStorage& s) -> absl::Status {
    auto it = file_sizes.find(s.relative_path);
    if (it == file_sizes.end()) {
      return absl::DataLossError(absl::StrCat(name_for_errors, ": '", printable(key), "' is in ",
                                              printable(s.relative_path),
                                              ", which the checkpoint does not have"));
    }
    if (s.offset > it->second || s.length > it->second - s.offset) {
      return absl::DataLossError(absl::StrCat(name_for_errors, ": '", printable(key),
                                              "' runs past the end of ", printable(s.relative_path),
                                              " (bytes ", s.offset, " + ", s.length, " of ",
                                              it->second, "): the file is truncated"));
    }
    spans[s.relative_path].push_back({{s.offset, s.offset + s.length}, key});
    return absl::OkStatus();
  };
  for (const auto& [key, t] : metadata.tensors) {
    for (const DcpChunk& c : t.chunks) {
      if (absl::Status s = add(key, c.storage); !s.ok()) return s;
    }
  }
  for (const auto& [key, s] : metadata.objects) {
    if (absl::Status st = add(key, s); !st.ok()) return st;
  }
  for (auto& [file, list] : spans) {
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i) {
      if (list[i].first.first < list[i - 1].first.second) {
        return absl::DataLossError(absl::StrCat(name_for_errors, ": '", printable(list[i].second),
                                                "' and '", printable(list[i - 1].second),
                                                "' overlap in ", printable(file)));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace dtrain::checkpoint

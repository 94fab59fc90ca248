#include "checkpoint/torch_file_reader.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/pickle_reader.h"
#include "checkpoint/stored_zip.h"

namespace dtrain::checkpoint {
namespace {

// The legacy (pre-1.6) torch.save format starts with a pickled magic number:
// PROTO 2, LONG1 of 10 bytes, 0x1950a86a20f9469cfc6c little-endian.
constexpr char kLegacyMagic[] = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19";

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

std::string printable_start(std::string_view bytes) {
  std::string out;
  for (char c : bytes.substr(0, 8))
    absl::StrAppendFormat(&out, "%02x", static_cast<unsigned char>(c));
  return out;
}

// The zip archive torch.save writes, or why `bytes` are not one: PyTorch's legacy format, or no
// zip at all.
absl::StatusOr<StoredZip> open_archive(std::string_view bytes, const std::string& name,
                                       const TorchFileReadOptions& options) {
  if (starts_with(bytes, std::string_view(kLegacyMagic, sizeof(kLegacyMagic) - 1))) {
    return absl::InvalidArgumentError(absl::StrCat(name,
                                                   " is in PyTorch's legacy (pre-1.6) torch.save "
                                                   "format, which dtrain does not read: in Python, "
                                                   "load it and save it again with torch.save(obj, "
                                                   "path, _use_new_zipfile_serialization=True)"));
  }
  absl::StatusOr<StoredZip> zip = read_stored_zip(bytes, name, options.verify_entry_crcs);
  if (!zip.ok()) {
    if (zip.status().code() == absl::StatusCode::kDataLoss && !bytes.empty() &&
        !starts_with(bytes, "PK")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       " is not a PyTorch file: torch.save writes a zip archive, which starts with "
                       "\"PK\"; this starts "
                       "with the bytes ",
                       printable_start(bytes), " and ", zip.status().message()));
    }
    return zip.status();
  }
  return zip;
}

// The archive's one <prefix>/data.pkl entry, with its prefix (a view into the entry's name).
struct PickleEntry {
  const ZipEntry* entry = nullptr;
  std::string_view prefix;
};

absl::StatusOr<PickleEntry> find_pickle(const StoredZip& zip, const std::string& name) {
  PickleEntry found;
  for (const ZipEntry& e : zip.entries) {
    const size_t slash = e.name.find('/');
    if (slash == std::string::npos || slash == 0) continue;
    const std::string_view rest = std::string_view(e.name).substr(slash + 1);
    if (rest == "constants.pkl" || starts_with(rest, "code/")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name,
                       " is a TorchScript module archive (torch.jit.save), not a torch.save file; "
                       "dtrain reads state "
                       "dicts: in Python, torch.save(module.state_dict(), path)"));
    }
    if (rest != "data.pkl") continue;
    if (found.entry != nullptr) {
      return absl::DataLossError(absl::StrCat(name, " is damaged: it holds two pickles, ",
                                              found.entry->name, " and ", e.name));
    }
    found.entry = &e;
    found.prefix = std::string_view(e.name).substr(0, slash);
  }
  if (found.entry == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     " is a zip archive without a <name>/data.pkl entry, so not a file torch.save "
                     "wrote; save the "
                     "state with torch.save (Python) or dtrain::checkpoint::save_state"));
  }
  return found;
}

using Storages = std::unordered_map<std::string_view, const ZipEntry*>;

// The entries under `data_dir` by storage key, once the archive's byteorder is known to be
// little-endian (or unrecorded) and no two storages share bytes.
absl::StatusOr<Storages> find_storages(const StoredZip& zip, std::string_view prefix,
                                       const std::string& data_dir, const std::string& name) {
  Storages storages;
  for (const ZipEntry& e : zip.entries) {
    if (e.name == absl::StrCat(std::string(prefix), "/byteorder") && e.data != "little") {
      if (e.data == "big") {
        return absl::InvalidArgumentError(
            absl::StrCat(name,
                         " was written on a big-endian machine, which dtrain does not read: load "
                         "it in Python on a "
                         "little-endian machine and torch.save it again"));
      }
      return absl::DataLossError(
          absl::StrCat(name,
                       " is damaged: its byteorder entry is neither \"little\" nor "
                       "\"big\""));
    }
    if (starts_with(e.name, data_dir))
      storages.emplace(std::string_view(e.name).substr(data_dir.size()), &e);
  }
  // Storages never share bytes (a real zip's entries do not overlap; tensors may alias `bytes`).
  std::vector<const ZipEntry*> by_place;
  for (const auto& kv : storages) by_place.push_back(kv.second);
  std::sort(by_place.begin(), by_place.end(),
            [](const ZipEntry* a, const ZipEntry* b) { return a->data.data() < b->data.data(); });
  for (size_t i = 1; i < by_place.size(); ++i) {
    if (by_place[i - 1]->data.data() + by_place[i - 1]->data.size() > by_place[i]->data.data()) {
      return absl::DataLossError(absl::StrCat(name, " is damaged: zip entries ",
                                              by_place[i - 1]->name, " and ", by_place[i]->name,
                                              " overlap"));
    }
  }
  return storages;
}

// Storage `entry` as `numel` elements of `dtype`: a view into the caller's bytes where
// options.owner keeps them alive and the alignment allows, else a copy.
absl::StatusOr<at::Storage> load_storage(const ZipEntry& entry, at::ScalarType dtype, int64_t numel,
                                         const std::string& name,
                                         const TorchFileReadOptions& options) {
  const std::string_view data = entry.data;
  const auto nbytes =
      static_cast<uint64_t>(numel) * c10::elementSize(dtype);  // caller checked: no overflow
  if (nbytes > data.size()) {
    return absl::DataLossError(absl::StrCat(name, " is damaged: storage ", entry.name, " holds ",
                                            data.size(), " bytes, its pickle says ", numel,
                                            " elements of ", c10::toString(dtype), " (", nbytes,
                                            " bytes)"));
  }
  if (dtype == at::kBool) {
    for (size_t i = 0; i < nbytes; ++i) {
      if (static_cast<unsigned char>(data[i]) > 1) {
        return absl::DataLossError(absl::StrCat(name, " is damaged: bool storage ", entry.name,
                                                " holds a byte other than 0 or 1 at ", i));
      }
    }
  }
  const auto address = reinterpret_cast<uintptr_t>(data.data());
  if (options.owner != nullptr && address % c10::elementSize(dtype) == 0) {
    // A view into the caller's bytes, holding a reference to their owner.
    auto* keep = new std::shared_ptr<const void>(options.owner);
    at::DataPtr ptr(
        const_cast<char*>(data.data()), keep,
        [](void* k) { delete static_cast<std::shared_ptr<const void>*>(k); }, at::Device(at::kCPU));
    return at::Storage(at::Storage::use_byte_size_t(), static_cast<int64_t>(nbytes), std::move(ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  }
  try {
    at::Tensor buffer =
        at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
    if (nbytes > 0) std::memcpy(buffer.data_ptr(), data.data(), nbytes);
    return buffer.storage();
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", nbytes, " bytes for storage ", entry.name, " of ", name,
                     ": ", std::string(e.what()).substr(0, 200)));
  }
}

absl::StatusOr<c10::IValue> read(std::string_view bytes, const std::string& name,
                                 const TorchFileReadOptions& options) {
  absl::StatusOr<StoredZip> zip = open_archive(bytes, name, options);
  if (!zip.ok()) return zip.status();
  absl::StatusOr<PickleEntry> pickle = find_pickle(*zip, name);
  if (!pickle.ok()) return pickle.status();
  const std::string data_dir = absl::StrCat(std::string(pickle->prefix), "/data/");
  absl::StatusOr<Storages> storages = find_storages(*zip, pickle->prefix, data_dir, name);
  if (!storages.ok()) return storages.status();
  const StorageLoader loader = [&](const std::string& key, at::ScalarType dtype,
                                   int64_t numel) -> absl::StatusOr<at::Storage> {
    auto it = storages->find(key);
    if (it == storages->end()) {
      return absl::DataLossError(absl::StrCat(name, " is damaged: its pickle refers to storage ",
                                              key.substr(0, 64), " but the archive has no entry ",
                                              data_dir, key.substr(0, 64)));
    }
    return load_storage(*it->second, dtype, numel, name, options);
  };
  return read_pickle(pickle->entry->data, name, loader);
}

// torch.load's map_location: moves every tensor in a value to one device in place, one copy per
// storage, so tensors that shared a storage share its copy and a tensor reached twice stays one
// tensor. Containers keep their identity and element types. Throws what LibTorch throws.
class DeviceMover {
 public:
  explicit DeviceMover(c10::Device device) : device_(device) {}

  void move_all(c10::IValue& root) {
    if (root.isTensor()) {
      root = c10::IValue(moved(root.toTensor()));
      return;
    }
    std::unordered_set<const void*> seen;  // shared and recursive containers: once each
    std::vector<c10::IValue> pending = {root};
    while (!pending.empty()) {
      const c10::IValue v = std::move(pending.back());
      pending.pop_back();
      if (!(v.isTuple() || v.isList() || v.isGenericDict()) ||
          !seen.insert(v.internalToPointer()).second)
        continue;
      if (v.isTuple()) {
        const c10::intrusive_ptr<c10::ivalue::Tuple> tuple = v.toTuple();
        for (size_t i = 0; i < tuple->elements().size(); ++i) {
          const c10::IValue e = tuple->elements()[i];
          if (e.isTensor()) {
            tuple->unsafeSetElement(i, c10::IValue(moved(e.toTensor())));
          } else {
            pending.push_back(e);
          }
        }
      } else if (v.isList()) {
        c10::impl::GenericList list = v.toList();
        for (size_t i = 0; i < list.size(); ++i) {
          const c10::IValue e = list.get(i);
          if (e.isTensor()) {
            list.set(i, c10::IValue(moved(e.toTensor())));
          } else {
            pending.push_back(e);
          }
        }
      } else {
        c10::impl::GenericDict dict = v.toGenericDict();
        std::vector<std::pair<c10::IValue, c10::IValue>> items;
        bool tensor_keys = false;
        for (const auto& kv : dict) {
          tensor_keys |= kv.key().isTensor();
          items.emplace_back(kv.key(), kv.value());
        }
        for (auto& [key, value] : items) {
          if (key.isTensor()) key = c10::IValue(moved(key.toTensor()));
          if (value.isTensor()) {
            value = c10::IValue(moved(value.toTensor()));
          } else {
            pending.push_back(value);
          }
        }
        if (tensor_keys) {  // a key hashes by tensor identity: the dict is refilled, in its order
          dict.clear();
          for (auto& [key, value] : items) dict.insert(std::move(key), std::move(value));
        } else {
          for (auto& [key, value] : items) {
            if (value.isTensor()) dict.insert_or_assign(key, value);
          }
        }
      }
    }
  }

 private:
  at::Tensor moved(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return t;
    if (auto it = tensors_.find(t.unsafeGetTensorImpl()); it != tensors_.end())
      return it->second.second;
    const at::Storage& storage = t.storage();
    auto st = storages_.find(storage.unsafeGetStorageImpl());
    if (st == storages_.end()) {
      // A byte tensor over the whole storage, copied to the device in one piece.
      at::Tensor whole = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(t.device()));
      whole.set_(storage, 0, std::vector<int64_t>{static_cast<int64_t>(storage.nbytes())},
                 std::vector<int64_t>{1});
      at::Storage copy = whole.to(device_).storage();
      st = storages_
               .emplace(storage.unsafeGetStorageImpl(), std::make_pair(storage, std::move(copy)))
               .first;
    }
    const at::Storage& target = st->second.second;
    at::Tensor out =
        at::empty({0}, at::TensorOptions().dtype(t.scalar_type()).device(target.device()));
    out.set_(target, t.storage_offset(), t.sizes(), t.strides());
    if (t.requires_grad()) out.requires_grad_(true);
    tensors_.emplace(t.unsafeGetTensorImpl(), std::make_pair(t, out));
    return out;
  }

  c10::Device device_;
  // By the source's address, holding the source too: a source freed while the walk replaces it
  // could otherwise leave its address to a new tensor or storage.
  std::unordered_map<const void*, std::pair<at::Tensor, at::Tensor>> tensors_;
  std::unordered_map<const void*, std::pair<at::Storage, at::Storage>> storages_;
};

absl::Status move_to(c10::IValue& value, c10::Device device, const std::string& name) {
  try {
    DeviceMover(device).move_all(value);
    return absl::OkStatus();
  } catch (const c10::OutOfMemoryError& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory on ", device.str(), " moving the tensors of ", name,
                     " there (map_location): ", std::string(e.what()).substr(0, 300),
                     "; load onto the CPU (the default) and move what fits"));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot move the tensors of ", name, " to ", device.str(),
                     " (map_location): ", std::string(e.what()).substr(0, 300),
                     "; pass a device this process has, or the CPU (the default)"));
  }
}

}  // namespace

absl::StatusOr<c10::IValue> read_torch_file(std::string_view bytes,
                                            const std::string& name_for_errors,
                                            const TorchFileReadOptions& options) {
  absl::StatusOr<c10::IValue> v = read(bytes, name_for_errors, options);
  if (v.status().code() == absl::StatusCode::kDataLoss) {
    return absl::DataLossError(
        absl::StrCat(v.status().message(),
                     ". The file cannot be used as it is: load another copy, or save it again"));
  }
  if (v.ok() && !options.map_location.is_cpu()) {
    if (absl::Status s = move_to(*v, options.map_location, name_for_errors); !s.ok()) return s;
  }
  return v;
}

}  // namespace dtrain::checkpoint

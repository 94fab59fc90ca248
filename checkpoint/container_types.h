// Element types for the containers a state file brings back. A pickle records no element types
// (Python's lists and dicts have none), so a reader gets List[Any] and Dict[Any, Any]; C++ code
// that saved a c10::List<at::Tensor> wants one back (toTensorVector() refuses a List[Any]).
// `type_homogeneous_containers` gives every non-empty list whose elements are all of one type
// (Tensor, int, float, bool or str) that element type, and every non-empty dict its key and
// value types where each is one type, in place, through the whole value (shared and recursive
// containers included). What is mixed or empty stays Any: the file cannot say more.
//
//   absl::StatusOr<c10::IValue> v = read_torch_file(bytes, name);
//   if (v.ok()) dtrain::checkpoint::type_homogeneous_containers(*v);
//   v->toGenericDict().at("grads").toTensorVector();   // saved as a c10::List<at::Tensor>
#ifndef DTRAIN_CHECKPOINT_CONTAINER_TYPES_H_
#define DTRAIN_CHECKPOINT_CONTAINER_TYPES_H_

#include <ATen/core/ivalue.h>

namespace dtrain::checkpoint {

void type_homogeneous_containers(const c10::IValue& root);

}  // namespace dtrain::checkpoint

#endif  // DTRAIN_CHECKPOINT_CONTAINER_TYPES_H_

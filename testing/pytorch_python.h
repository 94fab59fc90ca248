// The Python interpreter with PyTorch that tests run as their oracle: $DTRAIN_PYTHON when set and
// not empty (a venv with another PyTorch: docs/checkpoints.md; .ci/cmake_wheel's whole-project
// run), else /usr/bin/python3 (the Debian roots' python3-torch). Shell tests read the same
// variable (examples/train_test.sh).
//
//   const std::string cmd = dtrain::testing::pytorch_python() + " optim/testdata/make_x.py " + dir;
#ifndef DTRAIN_TESTING_PYTORCH_PYTHON_H_
#define DTRAIN_TESTING_PYTORCH_PYTHON_H_

#include <cstdlib>
#include <string>

namespace dtrain::testing {

inline std::string pytorch_python() {
  const char* p = std::getenv("DTRAIN_PYTHON");
  return p != nullptr && *p != '\0' ? p : "/usr/bin/python3";
}

}  // namespace dtrain::testing

#endif  // DTRAIN_TESTING_PYTORCH_PYTHON_H_

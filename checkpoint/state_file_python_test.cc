// load_state on files Python's torch.save wrote at test time (checkpoint/testdata/
// make_python_files.py; $DTRAIN_PYTHON or /usr/bin/python3, or files already written under
// $DTRAIN_PYTHON_FILES_DIR, e.g. by PyTorch 2.6): every value equal to what Python saved, bit for
// bit, and the files dtrain refuses refused with the right words.
#include <sys/stat.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/python_test_files.h"
#include "checkpoint/state_file.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;

class PythonFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::string> dir = testing::python_files_dir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
  }
  std::string dir_;
};

TEST_F(PythonFilesTest, ValuesEqualWhatPythonSaved) {
  for (const char* name : {"adam_one", "adam_many", "adam_two_groups", "adam_amsgrad",
                           "sgd_momentum", "rmsprop_centered", "adagrad", "adamw", "scheduler",
                           "nested", "float64", "protocol4", "protocol5", "views", "dtypes"}) {
    SCOPED_TRACE(name);
    const std::string path = dir_ + "/" + name + ".pt";
    absl::StatusOr<c10::IValue> v = load_state(path);
    ASSERT_TRUE(v.ok()) << v.status();
    const std::vector<std::string> want = testing::read_lines(dir_ + "/" + name + ".txt");
    ASSERT_FALSE(want.empty()) << "no digest for " << name;
    const std::vector<std::string> got = testing::digest(*v);
    EXPECT_EQ(got.size(), want.size());
    for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
      ASSERT_EQ(got[i], want[i]) << "first difference at line " << i + 1;
    }
    // Python's top-level dicts have str keys; load_state types them (checkpoint/container_types.h).
    EXPECT_THAT(v->type()->str(), ::testing::StartsWith("Dict(str, "));
  }
}

TEST_F(PythonFilesTest, OptimizerStateHasTheShapeOtherCodeExpects) {
  absl::StatusOr<c10::IValue> v = load_state(dir_ + "/adam_two_groups.pt");
  ASSERT_TRUE(v.ok()) << v.status();
  const c10::impl::GenericDict sd = v->toGenericDict();
  const c10::impl::GenericDict state = sd.at("state").toGenericDict();
  ASSERT_EQ(state.size(), 3u);
  for (const auto& kv : state) {
    EXPECT_TRUE(kv.key().isInt());
    const c10::impl::GenericDict s = kv.value().toGenericDict();
    EXPECT_EQ(s.at("exp_avg").toTensor().sizes(), s.at("exp_avg_sq").toTensor().sizes());
    EXPECT_TRUE(s.at("exp_avg").toTensor().device().is_cpu());
  }
  const c10::List<c10::IValue> groups = sd.at("param_groups").toList();
  ASSERT_EQ(groups.size(), 2u);
  const c10::impl::GenericDict g1 = groups.get(1).toGenericDict();
  EXPECT_EQ(g1.at("lr").toDouble(), 0.5);
  EXPECT_EQ(g1.at("betas").toTupleRef().elements()[0].toDouble(), 0.8);
  EXPECT_EQ(g1.at("params").toList().get(0).toInt(), 2);

  absl::StatusOr<c10::IValue> sched = load_state(dir_ + "/scheduler.pt");
  ASSERT_TRUE(sched.ok()) << sched.status();
  const c10::impl::GenericDict group =
      sched->toGenericDict().at("param_groups").toList().get(0).toGenericDict();
  EXPECT_EQ(group.at("initial_lr").toDouble(), 0.1);
  EXPECT_EQ(group.at("lr").toDouble(), 0.05);

  absl::StatusOr<c10::IValue> views = load_state(dir_ + "/views.pt");
  ASSERT_TRUE(views.ok()) << views.status();
  const c10::impl::GenericDict vd = views->toGenericDict();
  for (const char* name : {"slice", "t", "strided"}) {
    EXPECT_TRUE(vd.at("base").toTensor().storage().is_alias_of(vd.at(name).toTensor().storage()))
        << name;
  }
  EXPECT_FALSE(vd.at("base").toTensor().storage().is_alias_of(vd.at("other").toTensor().storage()));

  absl::StatusOr<c10::IValue> nested = load_state(dir_ + "/nested.pt");
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_TRUE(nested->toGenericDict().at("param").toTensor().requires_grad());
  EXPECT_EQ(nested->toGenericDict()
                .at("model")
                .toGenericDict()
                .at("1.num_batches_tracked")
                .toTensor()
                .item<int64_t>(),
            2);
}

TEST_F(PythonFilesTest, LegacyFormatIsRefusedWithWhatToDo) {
  const std::string path = dir_ + "/legacy.pt";
  absl::StatusOr<c10::IValue> v = load_state(path);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(v.status().message()),
              HasSubstr("state file " + path + " is in PyTorch's legacy"));
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("_use_new_zipfile_serialization=True"));
}

TEST_F(PythonFilesTest, PicklesOfObjectsAreRefusedAndNothingRuns) {
  absl::StatusOr<c10::IValue> object = load_state(dir_ + "/object.pt");
  EXPECT_EQ(object.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(object.status().message()),
              HasSubstr("the Python global __main__.Thing"));
  EXPECT_THAT(std::string(object.status().message()),
              HasSubstr("state file " + dir_ + "/object.pt"));

  absl::StatusOr<c10::IValue> system = load_state(dir_ + "/os_system.pt");
  EXPECT_EQ(system.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(system.status().message()), HasSubstr("the Python global posix.system"));
  EXPECT_THAT(std::string(system.status().message()), HasSubstr("never runs code from a file"));
  struct stat st;
  EXPECT_NE(::stat((dir_ + "/os_system_ran").c_str(), &st), 0) << "the pickle's os.system ran";
}

}  // namespace
}  // namespace dtrain::checkpoint

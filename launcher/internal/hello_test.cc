#include "launcher/internal/hello.h"

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace dtrain::comm::internal {
namespace {

using ::testing::HasSubstr;

const Hello kJob{0, 2, 3, 1, "job-7"};  // node 0 of 3 nodes, 2 ranks each, 1 restart

// The reason `line` is refused, or "admitted as node K".
std::string verdict(const std::string& line) {
  absl::StatusOr<int> k = admit(line, kJob);
  if (k.ok()) return "admitted as node " + std::to_string(*k);
  EXPECT_TRUE(absl::IsInvalidArgument(k.status())) << k.status();
  return std::string(k.status().message());
}

TEST(HelloTest, ALaunchersOwnHelloIsAdmitted) {
  for (int node = 1; node < 3; ++node) {
    const std::string line = hello_line({node, 2, 3, 1, "job-7"});
    EXPECT_EQ(line, "HELLO " + std::to_string(node) + " 2 3 1 job-7");
    EXPECT_EQ(verdict(line), "admitted as node " + std::to_string(node));
  }
}

// The stranger: a HELLO of the old form, with every number right, carries no run id.
TEST(HelloTest, AHelloWithoutARunIdIsRefused) {
  EXPECT_THAT(verdict("HELLO 1 2 3 1"),
              HasSubstr("node 1's HELLO carries no run id (\"HELLO 1 2 3 1\"); every node's "
                        "launcher must be given the same --rdzv_id"));
}

TEST(HelloTest, AnotherJobsRunIdIsRefused) {
  EXPECT_EQ(verdict("HELLO 1 2 3 1 job-8"),
            "node 1's --rdzv_id \"job-8\" is not this job's; give every node's launcher the same "
            "--rdzv_id");
  EXPECT_THAT(verdict("HELLO 1 2 3 1 none"), HasSubstr("\"none\" is not this job's"));
}

TEST(HelloTest, OtherSettingsAreRefusedNamingBoth) {
  EXPECT_EQ(verdict("HELLO 2 2 4 1 job-7"),
            "node 2 has nproc_per_node 2, nnodes 4, max_restarts 1; node 0 has 2, 3, 1; give "
            "every node the same");
  EXPECT_THAT(verdict("HELLO 1 1 3 1 job-7"), HasSubstr("node 1 has nproc_per_node 1"));
  EXPECT_THAT(verdict("HELLO 1 2 3 0 job-7"), HasSubstr("max_restarts 0; node 0 has 2, 3, 1"));
}

TEST(HelloTest, NodeRanksOutsideTheJobAreRefused) {
  for (const char* k : {"0", "3", "-1", "2147483647"}) {
    EXPECT_EQ(verdict(std::string("HELLO ") + k + " 2 3 1 job-7"),
              std::string("node_rank ") + k + " is not in [1, 2]");
  }
}

// Whatever a stranger sends is refused with a reason that is one printable line of bounded size.
TEST(HelloTest, GarbageIsRefusedInOneShortPrintableLine) {
  const std::string cases[] = {"",
                               "GET / HTTP/1.1\r",
                               "HELLO",
                               "HELLO 1 2 3 1 job-7 extra",
                               "HELLO x 2 3 1 job-7",
                               "HELLO 1 2 3 99999999999 job-7",
                               "HELLO  1 2 3 1 job-7",
                               std::string("HELLO 1 2 3 1 \n\x01\xff", 17),
                               "HELLO 1 2 3 1 " + std::string(4000, 'j'),
                               std::string(4000, '\xff')};
  for (const std::string& line : cases) {
    const std::string why = verdict(line);
    EXPECT_THAT(why, ::testing::Not(HasSubstr("admitted"))) << line;
    EXPECT_LT(why.size(), 400u) << line;
    for (char c : why) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "in " << why;
  }
  EXPECT_THAT(verdict("GET / HTTP/1.1\r"),
              HasSubstr("the first line, \"GET / HTTP/1.1\\r\", is not a launcher's HELLO"));
  EXPECT_THAT(verdict("HELLO 1 2 3 1 job-7 extra"),
              HasSubstr("a malformed HELLO \"HELLO 1 2 3 1 job-7 extra\"; expected \"HELLO "
                        "node_rank nproc_per_node nnodes max_restarts rdzv_id\""));
}

TEST(HelloTest, RdzvIdsAreOneWordOfSafeCharacters) {
  for (const char* good : {"none", "job-7.a_b", "A"}) EXPECT_TRUE(valid_rdzv_id(good)) << good;
  EXPECT_TRUE(valid_rdzv_id(std::string(kMaxRdzvIdLength, 'a')));
  for (const std::string& bad : {std::string(), std::string("a b"), std::string("x/y"),
                                 std::string("a\nb"), std::string(kMaxRdzvIdLength + 1, 'a')}) {
    EXPECT_FALSE(valid_rdzv_id(bad)) << bad;
  }
}

}  // namespace
}  // namespace dtrain::comm::internal

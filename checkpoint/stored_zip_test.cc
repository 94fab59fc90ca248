#include "checkpoint/stored_zip.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint/test_zip.h"

namespace dtrain::checkpoint {
namespace {

using ::testing::HasSubstr;
using testing::make_zip;
using testing::ZipOptions;

const std::vector<std::pair<std::string, std::string>> kEntries = {
    {"archive/data.pkl", "pickle bytes"},
    {"archive/data/0", std::string(100, '\x07')},
    {"archive/version", "3\n"}};

std::string message(const absl::Status& s) { return std::string(s.message()); }

TEST(StoredZipTest, ReadsEntriesCommentAndEndRecord) {
  for (bool zip64 : {false, true}) {
    ZipOptions o;
    o.zip64 = zip64;
    o.comment = "a comment";
    const std::string zip = make_zip(kEntries, o);
    absl::StatusOr<StoredZip> z = read_stored_zip(zip, "file x.pt");
    ASSERT_TRUE(z.ok()) << z.status();
    ASSERT_EQ(z->entries.size(), kEntries.size());
    for (size_t i = 0; i < kEntries.size(); ++i) {
      EXPECT_EQ(z->entries[i].name, kEntries[i].first);
      EXPECT_EQ(z->entries[i].data, kEntries[i].second);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(z->entries[i].data.data()) % 64,
                reinterpret_cast<uintptr_t>(zip.data()) % 64);
    }
    EXPECT_EQ(z->comment, "a comment");
    EXPECT_EQ(z->eocd_offset, zip.size() - 22 - 9);
  }
}

TEST(StoredZipTest, EndRecordMustEndTheFile) {
  const std::string zip = make_zip(kEntries);
  absl::StatusOr<StoredZip> appended = read_stored_zip(zip + "x", "file x.pt");
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(
      message(appended.status()),
      HasSubstr("file x.pt is damaged: no end-of-central-directory record ends at the end"));
  ZipOptions o;
  o.comment = "comment";
  const std::string with_comment = make_zip(kEntries, o);
  EXPECT_FALSE(read_stored_zip(with_comment.substr(0, with_comment.size() - 1), "f").ok());
  EXPECT_THAT(message(read_stored_zip("", "file e.pt").status()),
              HasSubstr("file e.pt is damaged: only 0 bytes"));
}

TEST(StoredZipTest, EveryTruncationIsAnError) {
  for (bool zip64 : {false, true}) {
    ZipOptions o;
    o.zip64 = zip64;
    const std::string zip = make_zip(kEntries, o);
    for (size_t cut = 0; cut < zip.size(); ++cut) {
      absl::StatusOr<StoredZip> z = read_stored_zip(std::string_view(zip).substr(0, cut), "f");
      EXPECT_EQ(z.status().code(), absl::StatusCode::kDataLoss) << "cut at " << cut;
    }
  }
}

TEST(StoredZipTest, CrcMismatchNamesTheEntry) {
  std::string zip = make_zip(kEntries);
  zip[zip.find(std::string(100, '\x07')) + 50] ^= 1;
  absl::StatusOr<StoredZip> z = read_stored_zip(zip, "file x.pt");
  EXPECT_EQ(z.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(message(z.status()), HasSubstr("entry archive/data/0 fails its CRC-32 check"));
  EXPECT_TRUE(read_stored_zip(zip, "file x.pt", /*verify_crcs=*/false).ok());
}

TEST(StoredZipTest, CompressedEntriesAreRefused) {
  ZipOptions o;
  o.method = 8;
  absl::StatusOr<StoredZip> z = read_stored_zip(make_zip(kEntries, o), "file x.pt");
  EXPECT_EQ(z.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(message(z.status()),
              HasSubstr("entry archive/data.pkl is compressed (zip method 8)"));
}

TEST(StoredZipTest, InconsistentDirectoriesAreDataLoss) {
  std::string renamed = make_zip(kEntries);
  renamed[renamed.find("archive/version")] = 'A';  // the local header's copy of the name
  EXPECT_THAT(message(read_stored_zip(renamed, "f").status()),
              HasSubstr("local header names another file"));

  const std::string twice = make_zip({{"a/x", "1"}, {"a/x", "2"}});
  EXPECT_THAT(message(read_stored_zip(twice, "f").status()),
              HasSubstr("the entry name a/x occurs twice"));

  std::string many = make_zip(kEntries);
  many[many.size() - 12] = '\x7f';  // total entries: 127 in a 3-entry central directory
  many[many.size() - 14] = '\x7f';
  EXPECT_THAT(message(read_stored_zip(many, "f").status()),
              HasSubstr("more than a central directory"));

  std::string far = make_zip(kEntries);
  far[far.size() - 4] = '\x7f';  // central directory offset beyond the file
  EXPECT_THAT(message(read_stored_zip(far, "f").status()), HasSubstr("central directory"));
}

// An entry whose local header lies inside another entry's data: each passes its own checks, but
// entries must not share bytes (the CRC work would be quadratic, tensors could alias).
TEST(StoredZipTest, OverlappingEntriesAreDataLoss) {
  const std::string one = make_zip({{"a/y", "Q"}});
  const std::string inner = one.substr(0, one.find("PK\x01\x02"));  // a/y's local header and data
  std::string zip = make_zip({{"a/x", inner}, {"a/y", "Q"}});
  const size_t nested = zip.find(inner);
  const size_t second_central = zip.find("PK\x01\x02", zip.find("PK\x01\x02") + 4);
  ASSERT_NE(second_central, std::string::npos);
  for (int k = 0; k < 4; ++k)
    zip[second_central + 42 + k] = static_cast<char>((nested >> (8 * k)) & 0xff);
  EXPECT_THAT(message(read_stored_zip(zip, "f").status()), HasSubstr("two entries overlap"));
}

TEST(StoredZipTest, Crc32OfMatchesZlibInPieces) {
  const std::string data = "123456789";
  EXPECT_EQ(crc32_of(data), 0xcbf43926u);
  EXPECT_EQ(crc32_of(data.substr(4), crc32_of(data.substr(0, 4))), 0xcbf43926u);
}

}  // namespace
}  // namespace dtrain::checkpoint

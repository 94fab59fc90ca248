#!/bin/sh
# fresh_tmpdir.sh DIR COMMAND [ARGS...]: how ctest starts every dtrain test (cmake/dtrain_rules.cmake):
# DIR (the test's TEST_TMPDIR) emptied first, as Bazel gives each run a new one -- a test rerun
# must not find the files of its last run (examples:train would resume from them).
dir=$1
shift
rm -rf "$dir" && mkdir -p "$dir" && exec "$@"

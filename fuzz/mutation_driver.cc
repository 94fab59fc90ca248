// A main() for any fuzz target (fuzz/fuzz_target.h) that needs no libFuzzer: runs every seed,
// then random mutations of them (bit flips, extreme values, cuts, insertions -- of the target's
// dictionary tokens too --, deletions, duplications, splices of another seed) until the time is up. Input i is a pure function of
// (seed, i), so a crash is replayed exactly with the command it prints.
//
//   NAME_test                         DTRAIN_FUZZ_SECONDS (default 10), DTRAIN_FUZZ_SEED (default 1)
//   NAME_test --seconds=600 --seed=7  longer, another sequence
//   NAME_test --replay=123456         input 123456 of the sequence only (for a debugger)
//   NAME_test --write_seeds=DIR       writes the seeds as files (a corpus for libFuzzer)
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

// The weak default of fuzz_target.h's dictionary(): a target that defines one replaces it.
__attribute__((weak)) std::vector<std::string> dtrain::fuzz::dictionary() { return {}; }

namespace {

const std::vector<std::string>& tokens() {
  static const std::vector<std::string> kTokens = dtrain::fuzz::dictionary();
  return kTokens;
}

std::string mutate(std::string b, const std::vector<std::string>& all, std::mt19937_64& rng) {
  auto pos = [&](size_t size) { return static_cast<size_t>(rng() % (size + 1)); };
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:
        if (!b.empty()) b[rng() % b.size()] ^= static_cast<char>(1 << (rng() % 8));
        break;
      case 1: {
        static const char kInteresting[] = {'\0', '\x01', '\x7f', '\x80', '\xff'};
        if (!b.empty()) b[rng() % b.size()] = kInteresting[rng() % sizeof(kInteresting)];
        break;
      }
      case 2:
        b.resize(pos(b.size()));
        break;
      case 3:
        b.erase(pos(b.size()), rng() % 64);
        break;
      case 4:
        if (!tokens().empty() && rng() % 2 == 0) {  // a token of the format, whole
          b.insert(pos(b.size()), tokens()[rng() % tokens().size()]);
        } else {
          b.insert(pos(b.size()), std::string(1 + rng() % 16, static_cast<char>(rng())));
        }
        break;
      case 5: {
        const std::string& other = all[rng() % all.size()];
        if (!other.empty())
          b.insert(pos(b.size()), other.substr(rng() % other.size(), rng() % 128));
        break;
      }
      case 6:
        if (b.size() >= 8) {  // a 32- or 64-bit field set to an extreme
          const size_t width = rng() % 2 ? 4 : 8, at = rng() % (b.size() - width + 1);
          const uint64_t v =
              rng() % 2 ? ~uint64_t{0} : (rng() % 2 ? uint64_t{1} << 62 : rng() % 1024);
          for (size_t i = 0; i < width; ++i) b[at + i] = static_cast<char>(v >> (8 * i));
        }
        break;
      default:
        if (!b.empty()) {
          const size_t at = rng() % b.size();
          b.insert(at, b.substr(at, rng() % 32));
        }
    }
  }
  return b;
}

std::string input_number(const std::vector<std::string>& seeds, uint64_t seed, uint64_t i) {
  if (i < seeds.size()) return seeds[i];
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + i);
  return mutate(seeds[rng() % seeds.size()], seeds, rng);
}

std::atomic<int64_t> g_current{0};  // lock-free: read in the crash handler
uint64_t g_seed = 1;

void on_crash(int sig) {
  char msg[200];
  const int n = std::snprintf(
      msg, sizeof msg,
      "\nfuzz: crashed (signal %d) on input %lld; replay it with --seed=%llu --replay=%lld\n", sig,
      static_cast<long long>(g_current.load()), static_cast<unsigned long long>(g_seed),
      static_cast<long long>(g_current.load()));
  [[maybe_unused]] ssize_t w = ::write(2, msg, static_cast<size_t>(n));
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

long long flag(int argc, char** argv, const char* name, long long fallback) {
  const size_t len = std::strlen(name);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], name, len) == 0 && argv[i][len] == '=')
      return std::atoll(argv[i] + len + 1);
  }
  return fallback;
}

long long env(const char* name, long long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> seeds = dtrain::fuzz::seeds();
  if (seeds.empty()) {
    std::cerr << "fuzz: the target has no seeds\n";
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--write_seeds=", 14) == 0) {
      const std::string dir = argv[i] + 14;
      ::mkdir(dir.c_str(), 0755);
      for (size_t s = 0; s < seeds.size(); ++s) {
        std::ofstream(dir + "/seed-" + std::to_string(s), std::ios::binary) << seeds[s];
      }
      std::cout << "wrote " << seeds.size() << " seeds to " << dir << "\n";
      return 0;
    }
  }
  const long long seconds = flag(argc, argv, "--seconds", env("DTRAIN_FUZZ_SECONDS", 10));
  g_seed = static_cast<uint64_t>(flag(argc, argv, "--seed", env("DTRAIN_FUZZ_SEED", 1)));
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) ::signal(sig, on_crash);
  if (const long long replay = flag(argc, argv, "--replay", -1); replay >= 0) {
    g_current = replay;
    const std::string in = input_number(seeds, g_seed, static_cast<uint64_t>(replay));
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(in.data()), in.size());
    std::cout << "input " << replay << " (" << in.size() << " bytes): no crash\n";
    return 0;
  }
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  uint64_t i = 0;
  for (; i < seeds.size() || std::chrono::steady_clock::now() < end; ++i) {
    g_current = static_cast<int64_t>(i);
    const std::string in = input_number(seeds, g_seed, i);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(in.data()), in.size());
  }
  std::cout << "fuzz: seed " << g_seed << ", " << i << " inputs (" << seeds.size() << " seeds) in "
            << seconds << " s, no crash\n";
  return 0;
}

// What an RPC worker's TensorPipe listener exposes, and what stray bytes sent to it do.
//
// 1. By default every TCP socket an agent listens on is bound to loopback (AgentOptions::
//    listen_interface = "lo"): no other host can reach it. Read from /proc/net/tcp{,6} for the
//    sockets this process owns.
// 2. Stray bytes (random, or a lying length prefix) sent to the listener by a local client: the
//    worker runs in a child process that keeps calling itself; the test checks how the child
//    ended. TensorPipe decodes its handshake without bounding the lengths it reads, so on every
//    LibTorch checked so far (docs/rpc.md, "Stray bytes") the worker dies with std::bad_alloc;
//    a LibTorch that fixes it fails here, so that the docs get updated.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "rpc/agent.h"

namespace dtrain::rpc {
namespace {

struct Listener {
  std::string address;  // as /proc/net/tcp writes it: hex, network byte order per word
  bool loopback;
  int port;
};

// Socket inodes this process holds.
std::set<std::string> own_socket_inodes() {
  std::set<std::string> inodes;
  for (int fd = 0; fd < 4096; ++fd) {
    char link[256];
    std::string path = "/proc/self/fd/" + std::to_string(fd);
    ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
    if (n <= 0) continue;
    std::string target(link, n);
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  return inodes;
}

// TCP sockets in LISTEN state (st 0A) owned by this process.
std::vector<Listener> own_listeners() {
  std::set<std::string> inodes = own_socket_inodes();
  std::vector<Listener> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, st, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (st != "0A" || !inodes.count(inode)) continue;
      std::string addr = local.substr(0, local.find(':'));
      int port = std::stoi(local.substr(local.find(':') + 1), nullptr, 16);
      bool loopback = addr == "0100007F" || addr == "00000000000000000000000001000000";
      out.push_back({addr, loopback, port});
    }
  }
  return out;
}

std::unique_ptr<Agent> one_worker() {
  auto handlers = std::make_shared<Handlers>();
  handlers->add("echo", [](Request& r) { return Reply{Writer().str(r.body.str()), r.tensors}; });
  AgentOptions o;
  o.name = "w0";
  o.rank = 0;
  o.world_size = 1;
  o.store = c10::make_intrusive<c10d::HashStore>();
  o.handlers = handlers;
  o.num_worker_threads = 2;
  o.timeout = std::chrono::seconds(10);
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::create(o);
  TORCH_CHECK(agent.ok(), agent.status().ToString());
  return std::move(*agent);
}

TEST(RpcListenerTest, ListensOnLoopbackOnlyByDefault) {
  std::unique_ptr<Agent> agent = one_worker();
  std::vector<Listener> listeners = own_listeners();
  ASSERT_FALSE(listeners.empty()) << "the agent should listen on a TCP port";
  for (const Listener& l : listeners) {
    EXPECT_TRUE(l.loopback) << "port " << l.port << " listens on " << l.address
                            << " (hex, /proc/net/tcp), not loopback";
  }
  ASSERT_TRUE(agent->shutdown().ok());
}

void send_bytes(int port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    (void)!write(fd, bytes.data(), bytes.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  close(fd);
}

// The child: a worker calling itself for `seconds`; exits 0 when every call succeeded.
[[noreturn]] void serve_and_call(int port_pipe, int seconds) {
  std::unique_ptr<Agent> agent = one_worker();
  std::vector<Listener> listeners = own_listeners();
  int port = listeners.empty() ? 0 : listeners.front().port;
  (void)!write(port_pipe, &port, sizeof(port));
  close(port_pipe);
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int failed = 0;
  while (std::chrono::steady_clock::now() < end) {
    failed += !agent->rpc_sync("w0", "echo", Writer().str("ping")).ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  failed += !agent->shutdown().ok();
  std::fflush(nullptr);
  _exit(failed == 0 ? 0 : 3);
}

// How a worker ends when a local client sends `bytes` to its listener: "exit 0" (unharmed),
// "exit N", or "signal N".
std::string outcome_of(const std::string& bytes) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    serve_and_call(fds[1], 3);
  }
  close(fds[1]);
  int port = 0;
  EXPECT_EQ(read(fds[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(fds[0]);
  if (port > 0) send_bytes(port, bytes);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "exit " + std::to_string(WEXITSTATUS(status));
}

std::string random_bytes(int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen() & 0xff);
  return s;
}

TEST(RpcListenerTest, StrayBytes) {
  // docs/rpc.md, "Stray bytes": a client that connects and leaves harms no worker; bytes that are
  // not TensorPipe's handshake make TensorPipe throw std::bad_alloc on its own thread, which
  // aborts the worker (SIGABRT) -- on LibTorch 2.6 (Debian 13) and PyPI's 2.15 alike. dtrain's
  // answer is to listen on loopback unless told otherwise (the test above).
  struct Case {
    const char* name;
    std::string bytes;
    const char* expected;
  };
  std::vector<Case> cases = {
      {"empty", "", "exit 0"},
      {"random", random_bytes(256, 1), "signal 6"},
      {"lying_length", std::string(64, '\xff'), "signal 6"},
  };
  for (const Case& c : cases) {
    std::string end = outcome_of(c.bytes);
    RecordProperty(c.name, end);
    std::printf("stray bytes %-13s: worker %s\n", c.name, end.c_str());
    EXPECT_EQ(end, c.expected)
        << "stray bytes (" << c.name << ") no longer end a worker as docs/rpc.md (\"Stray bytes\") "
        << "and the README's Security section say: check the new behaviour and update them";
  }
}

}  // namespace
}  // namespace dtrain::rpc

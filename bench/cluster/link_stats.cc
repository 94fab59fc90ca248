#include "bench/cluster/link_stats.h"

#include <sys/resource.h>

#include <fstream>
#include <sstream>
#include <string>

namespace dtrain::bench {

int64_t tx_bytes() {
  std::ifstream dev("/proc/net/dev");
  std::string line;
  while (std::getline(dev, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || line.substr(0, colon).find("eth0") == std::string::npos)
      continue;
    std::istringstream fields(line.substr(colon + 1));
    int64_t v = 0;
    for (int i = 0; i < 9 && (fields >> v); ++i) {
    }
    return v;  // the 9th field: transmitted bytes
  }
  return 0;
}

double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

}  // namespace dtrain::bench

// One-way latency of a cache line between two cores: this machine's placement, printed beside
// every benchmark row.
//
// Why: the benchmarks run on a virtual machine whose 2 vCPUs the host places on physical cores
// it chooses, and moves: on the AMD machine of 2026-11-30 a line crossed in 30-40 ns at some
// moments and in 100-300 ns at others, changing every few seconds. Whatever hands data from one
// core to the other (loopback TCP and UDP, a sender's copy and its receiver's) may cost more
// when it is high; this number says what a row started on. (Read before a run, it did not
// predict gloo's two speeds on that machine: docs/results/backend.md.)
//
//   core_to_core [ROUNDS]   prints "ns" (one way, median of 5 runs of ROUNDS round trips)
//
// Two threads pinned to CPUs 0 and 1 bounce one atomic counter: each waits for the other's
// value, then writes the next one.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

alignas(64) std::atomic<long> line{0};

bool pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

double one_way_ns(long rounds) {
    line.store(0);
    std::thread other([rounds] {
        pin(1);
        for (long i = 0; i < rounds; ++i) {
            while (line.load(std::memory_order_acquire) != 2 * i + 1) {}
            line.store(2 * i + 2, std::memory_order_release);
        }
    });
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < rounds; ++i) {
        line.store(2 * i + 1, std::memory_order_release);
        while (line.load(std::memory_order_acquire) != 2 * i + 2) {}
    }
    auto t1 = std::chrono::steady_clock::now();
    other.join();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / rounds / 2;
}

}  // namespace

int main(int argc, char** argv) {
    long rounds = argc > 1 ? std::atol(argv[1]) : 100000;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || !CPU_ISSET(0, &allowed) || !CPU_ISSET(1, &allowed) ||
        !pin(0)) {
        std::fprintf(stderr, "core_to_core: needs CPUs 0 and 1\n");
        return 1;
    }
    std::vector<double> runs;
    for (int k = 0; k < 5; ++k) runs.push_back(one_way_ns(rounds));
    std::sort(runs.begin(), runs.end());
    std::printf("%.0f\n", runs[2]);
    return 0;
}

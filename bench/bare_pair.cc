// A bare UDP pair, this machine's limit for one sender: GSO sends into a GRO receiver, in C++,
// with no protocol (no headers beyond a message number, no pacing, checks or recovery).
//
// Why C++: the same pair in Python spends its time in the interpreter and leaves the kernel idle,
// so it measures Python, not the machine. bench/transport.py compiles this file with g++ and runs
// one process of each role.
//
//   bare_pair recv PORT SEG MESSAGES BYTES   prints one line per message: "bytes seconds cpu_s"
//   bare_pair send PORT SEG MESSAGES BYTES [RATE]   prints one line per message: "cpu_s"
//
// RATE (bytes/s, 0 or none: unpaced) paces the sender by a token bucket of 256 KB, the burst
// DLCP's hosts pace with: the same line-rate configuration without DLCP's protocol.
//
// Every SEG-byte segment starts with the message's number (uint32), so the receiver counts each
// message's bytes apart; a message spans its first to its last arriving byte. The sender pauses
// 50 ms between messages so that they do not overlap at the receiver.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

static double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu() {
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

static int receiver(int port, int messages) {
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  int big = 64 << 20, one = 1;
  if (setsockopt(s, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big) != 0)
    setsockopt(s, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
  setsockopt(s, IPPROTO_UDP, UDP_GRO, &one, sizeof one);
  sockaddr_in a = loopback(port);
  if (bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) { perror("bind"); return 1; }
  timeval tv{2, 0};  // a message whose tail was dropped ends after 2 s of silence
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);

  constexpr int kBatch = 16, kBuf = 65536;
  std::vector<char> bufs(kBatch * kBuf);
  std::vector<char> ctrl(kBatch * 64);
  mmsghdr msgs[kBatch];
  iovec iov[kBatch];
  std::vector<long> bytes(messages, 0);
  std::vector<double> first(messages, 0), last(messages, 0), cpu_first(messages, 0), cpu_last(messages, 0);
  for (;;) {  // until 2 s of silence after the last message
    for (int i = 0; i < kBatch; i++) {
      iov[i] = {bufs.data() + i * kBuf, kBuf};
      msgs[i].msg_hdr = {};
      msgs[i].msg_hdr.msg_iov = &iov[i];
      msgs[i].msg_hdr.msg_iovlen = 1;
      msgs[i].msg_hdr.msg_control = ctrl.data() + i * 64;
      msgs[i].msg_hdr.msg_controllen = 64;
    }
    int n = recvmmsg(s, msgs, kBatch, MSG_WAITFORONE, nullptr);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      if (errno == EINTR) continue;
      perror("recvmmsg");
      return 1;
    }
    double t = now(), c = cpu();
    for (int i = 0; i < n; i++) {
      int len = msgs[i].msg_len, gso = len;
      for (cmsghdr* cm = CMSG_FIRSTHDR(&msgs[i].msg_hdr); cm; cm = CMSG_NXTHDR(&msgs[i].msg_hdr, cm))
        if (cm->cmsg_level == IPPROTO_UDP && cm->cmsg_type == UDP_GRO) gso = *reinterpret_cast<int*>(CMSG_DATA(cm));
      for (int off = 0; off < len; off += gso) {
        uint32_t m;
        memcpy(&m, bufs.data() + i * kBuf + off, 4);
        if (m >= static_cast<uint32_t>(messages)) continue;
        if (bytes[m] == 0) { first[m] = t; cpu_first[m] = c; }
        bytes[m] += (len - off < gso ? len - off : gso);
        last[m] = t;
        cpu_last[m] = c;
      }
    }
  }
  for (int m = 0; m < messages; m++)
    printf("%ld %.6f %.6f\n", bytes[m], last[m] - first[m], cpu_last[m] - cpu_first[m]);
  return 0;
}

static void sleep_s(double s) {
  timespec ts{static_cast<time_t>(s), static_cast<long>((s - static_cast<time_t>(s)) * 1e9)};
  nanosleep(&ts, nullptr);
}

static int sender(int port, int seg, int messages, long total, double rate) {
  constexpr double kBurst = 256 * 1024;
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in a = loopback(port);
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) { perror("connect"); return 1; }
  const int per_call = (65507 / seg) * seg;
  std::vector<char> data(total);
  for (long i = 0; i < total; i++) data[i] = static_cast<char>(i * 2654435761u >> 24);
  usleep(300000);  // the receiver binds first
  for (int m = 0; m < messages; m++) {
    for (long off = 0; off < total; off += seg) memcpy(data.data() + off, &m, 4);
    double c0 = cpu(), t0 = now();
    for (long off = 0; off < total; off += per_call) {
      long len = total - off < per_call ? total - off : per_call;
      if (rate > 0) {  // at most kBurst ahead of rate x elapsed
        double ahead = (off + len - kBurst) / rate - (now() - t0);
        if (ahead > 0) sleep_s(ahead);
      }
      iovec iov{data.data() + off, static_cast<size_t>(len)};
      char ctrl[CMSG_SPACE(sizeof(uint16_t))] = {};
      msghdr mh{};
      mh.msg_iov = &iov;
      mh.msg_iovlen = 1;
      mh.msg_control = ctrl;
      mh.msg_controllen = sizeof ctrl;
      cmsghdr* cm = CMSG_FIRSTHDR(&mh);
      cm->cmsg_level = IPPROTO_UDP;
      cm->cmsg_type = UDP_SEGMENT;
      cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
      uint16_t g = seg;
      memcpy(CMSG_DATA(cm), &g, sizeof g);
      while (sendmsg(s, &mh, 0) < 0 && errno == ENOBUFS) {}  // loopback: retry a full qdisc
    }
    printf("%.6f\n", cpu() - c0);
    fflush(stdout);
    usleep(50000);
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    fprintf(stderr, "usage: %s recv|send PORT SEG MESSAGES BYTES [RATE]\n", argv[0]);
    return 2;
  }
  int port = atoi(argv[2]), seg = atoi(argv[3]), messages = atoi(argv[4]);
  long total = atol(argv[5]);
  double rate = argc == 7 ? atof(argv[6]) : 0;
  if (seg < 8 || seg > 65507 || messages < 1 || total < seg || rate < 0) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  return strcmp(argv[1], "recv") == 0 ? receiver(port, messages) : sender(port, seg, messages, total, rate);
}

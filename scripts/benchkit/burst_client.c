/* A burst of HTTP requests at once from C, so that the client's own event loop does not delay
 * the answers it times (a Python client on the same cores adds 100-250 ms to the last of 1,500:
 * scripts/bench_burst_floor.py). Each request goes on its own socket with `Connection: close`;
 * one epoll loop writes every request, then reads every answer's status line.
 *
 *   burst_client PORT N REQUEST_FILE   -> one line per request on stdout:
 *   "<status> <ms from the last byte written to the first byte read> <retry-after 0/1>
 *    <an OpenAI error body 0/1>" (the body's first bytes hold "error" and "message")
 *   status 0: no answer (refused, reset or timed out after 120 s).
 * Built by scripts/benchkit/c_burst.py with the system's cc. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  int fd, written, done, status, retry_after, openai_error;
  double sent_ms, first_ms;
  char head[4096];
  int head_len;
} Conn;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static char *read_file(const char *path, long *len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *len = ftell(f);
  rewind(f);
  char *buf = malloc(*len);
  if (fread(buf, 1, *len, f) != (size_t)*len) { fclose(f); free(buf); return NULL; }
  fclose(f);
  return buf;
}

static void finish(Conn *c, int ep) {
  epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->done = 1;
  if (c->head_len >= 12 && memcmp(c->head, "HTTP/", 5) == 0) c->status = atoi(c->head + 9);
  c->head[c->head_len < 4095 ? c->head_len : 4095] = 0;
  c->retry_after = strcasestr(c->head, "\nretry-after:") != NULL;
  c->openai_error = strstr(c->head, "\"error\"") && strstr(c->head, "\"message\"");
}

static void on_event(Conn *c, int ep, const char *req, long req_len) {
  if (c->written < req_len) {
    ssize_t n = write(c->fd, req + c->written, req_len - c->written);
    if (n < 0 && errno != EAGAIN) { finish(c, ep); return; }
    if (n > 0) c->written += n;
    if (c->written == req_len) {
      c->sent_ms = now_ms();
      struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
      epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
    }
    return;
  }
  char buf[8192];
  ssize_t n = read(c->fd, buf, sizeof buf);
  if (n > 0 && c->first_ms == 0) c->first_ms = now_ms();
  if (n > 0) {
    int room = (int)sizeof c->head - 1 - c->head_len;
    int take = n < room ? (int)n : room;
    memcpy(c->head + c->head_len, buf, take);
    c->head_len += take;
  }
  if (n == 0 || (n < 0 && errno != EAGAIN)) finish(c, ep);
}

int main(int argc, char **argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s PORT N REQUEST_FILE\n", argv[0]); return 2; }
  int port = atoi(argv[1]), n = atoi(argv[2]);
  long req_len;
  char *req = read_file(argv[3], &req_len);
  if (!req) { perror(argv[3]); return 2; }
  Conn *conns = calloc(n, sizeof *conns);
  int ep = epoll_create1(0), open_conns = 0;
  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port)};
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  for (int i = 0; i < n; i++) {
    Conn *c = &conns[i];
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (c->fd < 0 || (connect(c->fd, (void *)&addr, sizeof addr) < 0 && errno != EINPROGRESS)) {
      c->done = 1;
      continue;
    }
    struct epoll_event ev = {.events = EPOLLOUT, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev);
    open_conns++;
  }
  struct epoll_event events[256];
  double deadline = now_ms() + 120e3;
  while (open_conns > 0 && now_ms() < deadline) {
    int k = epoll_wait(ep, events, 256, 1000);
    for (int j = 0; j < k; j++) {
      Conn *c = events[j].data.ptr;
      on_event(c, ep, req, req_len);
      if (c->done) open_conns--;
    }
  }
  for (int i = 0; i < n; i++) {
    Conn *c = &conns[i];
    double ms = c->first_ms > 0 && c->sent_ms > 0 ? c->first_ms - c->sent_ms : -1;
    printf("%d %.3f %d %d\n", c->status, ms, c->retry_after, c->openai_error);
  }
  return 0;
}

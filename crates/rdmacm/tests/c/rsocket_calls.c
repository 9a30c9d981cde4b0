/* rsocket calls against <rdma/rsocket.h>, in one process: the errno of every failure as a
 * socket gives it, socket options, non-blocking connect with rpoll and SO_ERROR, rselect and
 * rpoll over an rsocket and a pipe together, vectored and message calls, MSG_PEEK, half
 * close, a refused connection, and datagrams. Prints "ok" when everything held. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <rdma/rsocket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/uio.h>
#include <unistd.h>

#define CHECK(cond)                                                                            \
	do {                                                                                   \
		if (!(cond)) {                                                                 \
			fprintf(stderr, "line %d: %s (errno %d: %s)\n", __LINE__, #cond, errno,  \
				strerror(errno));                                              \
			exit(1);                                                               \
		}                                                                              \
	} while (0)

/* `call` fails with -1 and errno `e`. */
#define FAILS(call, e)                                                                         \
	do {                                                                                   \
		errno = 0;                                                                     \
		long r_ = (long)(call);                                                        \
		if (r_ != -1 || errno != (e)) {                                                \
			fprintf(stderr, "line %d: %s gave %ld, errno %d (%s), not %s\n",        \
				__LINE__, #call, r_, errno, strerror(errno), #e);               \
			exit(1);                                                               \
		}                                                                              \
	} while (0)

static struct sockaddr_in loopback(uint16_t port)
{
	struct sockaddr_in a;
	memset(&a, 0, sizeof a);
	a.sin_family = AF_INET;
	a.sin_port = htons(port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static int intopt(int s, int level, int name)
{
	int v = -1;
	socklen_t len = sizeof v;
	CHECK(rgetsockopt(s, level, name, &v, &len) == 0 && len == sizeof v);
	return v;
}

/* Waits (bounded) for `events` on rsocket `s`. */
static void wait_for(int s, short events)
{
	struct pollfd p = { .fd = s, .events = events };
	CHECK(rpoll(&p, 1, 20000) == 1 && (p.revents & events));
}

static void streams(void)
{
	char buf[64];
	int one = 1, v;
	socklen_t len;
	struct sockaddr_in a = loopback(0), peer;

	FAILS(rsocket(AF_UNIX, SOCK_STREAM, 0), EAFNOSUPPORT);
	FAILS(rsocket(AF_INET, SOCK_RAW, 0), ESOCKTNOSUPPORT);
	FAILS(rsocket(AF_INET, SOCK_STREAM, IPPROTO_UDP), EPROTONOSUPPORT);
	FAILS(rclose(123456), EBADF);
	FAILS(rrecv(123456, buf, 1, 0), EBADF);

	int l = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(l >= 0);
	CHECK(rsetsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
	CHECK(intopt(l, SOL_SOCKET, SO_REUSEADDR) == 1);
	CHECK(rbind(l, (struct sockaddr *)&a, sizeof a) == 0);
	FAILS(rbind(l, (struct sockaddr *)&a, sizeof a), EINVAL);
	FAILS(rbind(l, (struct sockaddr *)&a, 4), EINVAL);
	CHECK(rlisten(l, 4) == 0);
	len = sizeof a;
	CHECK(rgetsockname(l, (struct sockaddr *)&a, &len) == 0 && len == sizeof a && a.sin_port != 0);
	CHECK(intopt(l, SOL_SOCKET, SO_ACCEPTCONN) == 1);
	CHECK(intopt(l, SOL_SOCKET, SO_TYPE) == SOCK_STREAM);

	/* Not connected yet. */
	int c = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(c >= 0 && c != l);
	FAILS(rrecv(c, buf, 4, 0), ENOTCONN);
	FAILS(rsend(c, "x", 1, 0), ENOTCONN);
	len = sizeof peer;
	FAILS(rgetpeername(c, (struct sockaddr *)&peer, &len), ENOTCONN);
	FAILS(rshutdown(c, SHUT_RDWR), ENOTCONN);
	FAILS(riomap(c, buf, sizeof buf, PROT_WRITE, 0, 0), EINVAL);
	FAILS(raccept(c, NULL, NULL), EINVAL);
	FAILS(rsetsockopt(c, SOL_SOCKET, SO_PASSCRED, &one, sizeof one), ENOPROTOOPT);
	FAILS(rsetsockopt(c, SOL_SOCKET, SO_RCVBUF, &one, 2), EINVAL);
	FAILS(rfcntl(c, F_DUPFD, 0), EINVAL);
	v = 64;
	CHECK(rsetsockopt(c, SOL_RDMA, RDMA_SQSIZE, &v, sizeof v) == 0);
	CHECK(intopt(c, SOL_RDMA, RDMA_SQSIZE) == 64);
	v = 1;
	CHECK(rsetsockopt(c, SOL_RDMA, RDMA_IOMAPSIZE, &v, sizeof v) == 0);

	/* Non-blocking connect: EINPROGRESS, POLLOUT once connected, SO_ERROR 0. */
	CHECK(rfcntl(c, F_SETFL, rfcntl(c, F_GETFL) | O_NONBLOCK) == 0);
	CHECK(rfcntl(c, F_GETFL) & O_NONBLOCK);
	errno = 0;
	CHECK(rconnect(c, (struct sockaddr *)&a, sizeof a) == 0 || errno == EINPROGRESS);
	wait_for(c, POLLOUT);
	CHECK(intopt(c, SOL_SOCKET, SO_ERROR) == 0);
	FAILS(rsetsockopt(c, SOL_RDMA, RDMA_SQSIZE, &v, sizeof v), EINVAL);
	FAILS(rrecv(c, buf, 4, 0), EAGAIN);
	CHECK(rfcntl(c, F_SETFL, 0) == 0);

	len = sizeof peer;
	int s = raccept(l, (struct sockaddr *)&peer, &len);
	CHECK(s >= 0 && len == sizeof peer && peer.sin_addr.s_addr == htonl(INADDR_LOOPBACK));
	len = sizeof peer;
	CHECK(rgetpeername(c, (struct sockaddr *)&peer, &len) == 0 && peer.sin_port == a.sin_port);

	/* Options of a connected socket. */
	CHECK(rsetsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
	CHECK(intopt(c, IPPROTO_TCP, TCP_NODELAY) == 1);
	v = intopt(c, IPPROTO_TCP, TCP_MAXSEG);
	CHECK(v >= 256 && v <= 4096);
	CHECK(intopt(c, SOL_RDMA, RDMA_SQSIZE) >= 64);
	struct linger lg = { 1, 3 }, lg2;
	CHECK(rsetsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof lg) == 0);
	len = sizeof lg2;
	CHECK(rgetsockopt(c, SOL_SOCKET, SO_LINGER, &lg2, &len) == 0 && lg2.l_onoff == 1 && lg2.l_linger == 3);
	unsigned char route[128];
	len = sizeof route;
	CHECK(rgetsockopt(c, SOL_RDMA, RDMA_ROUTE, route, &len) == 0 && len == 72);

	/* Vectored and message calls; a peek first. */
	struct iovec w[3] = { { "ab", 2 }, { "cde", 3 }, { "f", 1 } };
	CHECK(rwritev(c, w, 3) == 6);
	wait_for(s, POLLIN);
	CHECK(rrecv(s, buf, sizeof buf, MSG_PEEK) >= 1 && buf[0] == 'a');
	char b1[2], b2[10];
	struct iovec r[2] = { { b1, 2 }, { b2, sizeof b2 } };
	ssize_t n = 0;
	while (n < 6) {
		struct iovec rr[2] = { r[0], r[1] };
		ssize_t k = rreadv(s, rr, 2);
		CHECK(k > 0);
		if (n == 0 && k < 6) {
			/* The rest: into the second buffer only. */
			r[0].iov_len = 0;
			r[1].iov_base = b2 + (k - 2);
			r[1].iov_len = sizeof b2 - (k - 2);
		}
		n += k;
	}
	CHECK(memcmp(b1, "ab", 2) == 0 && memcmp(b2, "cdef", 4) == 0);
	struct msghdr m;
	memset(&m, 0, sizeof m);
	m.msg_iov = w;
	m.msg_iovlen = 3;
	CHECK(rsendmsg(s, &m, 0) == 6);
	memset(buf, 0, sizeof buf);
	struct iovec ri = { buf, sizeof buf };
	memset(&m, 0, sizeof m);
	m.msg_iov = &ri;
	m.msg_iovlen = 1;
	CHECK(rrecvmsg(c, &m, 0) > 0);
	CHECK(memcmp(buf, "abcdef", strlen(buf)) == 0);
	while (strlen(buf) < 6)
		CHECK(rrecv(c, buf + strlen(buf), 6 - strlen(buf), 0) > 0);
	CHECK(strcmp(buf, "abcdef") == 0);

	/* rselect and rpoll over the rsocket and a pipe. */
	int p[2];
	CHECK(pipe(p) == 0);
	int top = (s > p[0] ? s : p[0]) + 1;
	fd_set rd;
	struct timeval tv = { 0, 50000 };
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	FD_SET(p[0], &rd);
	CHECK(rselect(top, &rd, NULL, NULL, &tv) == 0);
	CHECK(write(p[1], "x", 1) == 1);
	FD_ZERO(&rd);
	FD_SET(s, &rd);
	FD_SET(p[0], &rd);
	tv.tv_sec = 20;
	CHECK(rselect(top, &rd, NULL, NULL, &tv) == 1 && FD_ISSET(p[0], &rd) && !FD_ISSET(s, &rd));
	CHECK(rsend(c, "y", 1, 0) == 1);
	struct pollfd pf[2] = { { .fd = s, .events = POLLIN }, { .fd = p[0], .events = POLLIN } };
	CHECK(rpoll(pf, 2, 20000) == 2 && (pf[0].revents & POLLIN) && (pf[1].revents & POLLIN));
	CHECK(rrecv(s, buf, 1, 0) == 1 && buf[0] == 'y');
	close(p[0]);
	close(p[1]);

	/* Half close: EPIPE for the writer, the end for the reader; then the other way. */
	CHECK(rsend(c, "last", 4, 0) == 4);
	CHECK(rshutdown(c, SHUT_WR) == 0);
	FAILS(rsend(c, "z", 1, 0), EPIPE);
	CHECK(rrecv(s, buf, 4, MSG_WAITALL) == 4 && memcmp(buf, "last", 4) == 0);
	CHECK(rrecv(s, buf, sizeof buf, 0) == 0);
	CHECK(rsend(s, "back", 4, 0) == 4);
	CHECK(rrecv(c, buf, 4, MSG_WAITALL) == 4 && memcmp(buf, "back", 4) == 0);
	CHECK(rclose(s) == 0);
	CHECK(rrecv(c, buf, sizeof buf, 0) == 0);
	CHECK(rclose(c) == 0);
	FAILS(rclose(c), EBADF);

	/* Nobody listens any more. */
	CHECK(rclose(l) == 0);
	int d = rsocket(AF_INET, SOCK_STREAM, 0);
	FAILS(rconnect(d, (struct sockaddr *)&a, sizeof a), ECONNREFUSED);
	CHECK(rclose(d) == 0);
}

static void datagrams(void)
{
	char buf[2048];
	socklen_t len;
	struct sockaddr_in a1 = loopback(0), a2 = loopback(0), from;
	int u1 = rsocket(AF_INET, SOCK_DGRAM, 0), u2 = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(u1 >= 0 && u2 >= 0);
	FAILS(rrecv(u1, buf, sizeof buf, 0), EINVAL);
	CHECK(rbind(u1, (struct sockaddr *)&a1, sizeof a1) == 0);
	CHECK(rbind(u2, (struct sockaddr *)&a2, sizeof a2) == 0);
	len = sizeof a1;
	CHECK(rgetsockname(u1, (struct sockaddr *)&a1, &len) == 0 && a1.sin_port != 0);
	len = sizeof a2;
	CHECK(rgetsockname(u2, (struct sockaddr *)&a2, &len) == 0 && a2.sin_port != 0);
	FAILS(rsend(u1, "x", 1, 0), EDESTADDRREQ);
	FAILS(rlisten(u1, 1), EOPNOTSUPP);
	CHECK(intopt(u1, SOL_SOCKET, SO_TYPE) == SOCK_DGRAM);
	for (int i = 0; i < 50; i++) {
		CHECK(rsendto(u1, "hello", 5, 0, (struct sockaddr *)&a2, sizeof a2) == 5);
		len = sizeof from;
		CHECK(rrecvfrom(u2, buf, sizeof buf, 0, (struct sockaddr *)&from, &len) == 5);
		CHECK(len == sizeof from && from.sin_port == a1.sin_port && memcmp(buf, "hello", 5) == 0);
		CHECK(rsendto(u2, buf, 5, 0, (struct sockaddr *)&from, len) == 5);
		CHECK(rrecv(u1, buf, sizeof buf, 0) == 5);
	}
	memset(buf, 7, sizeof buf);
	FAILS(rsendto(u1, buf, sizeof buf, 0, (struct sockaddr *)&a2, sizeof a2), EMSGSIZE);
	CHECK(rfcntl(u2, F_SETFL, O_NONBLOCK) == 0);
	FAILS(rrecv(u2, buf, sizeof buf, 0), EAGAIN);
	CHECK(rclose(u1) == 0 && rclose(u2) == 0);
}

int main(void)
{
	streams();
	datagrams();
	puts("ok");
	return 0;
}

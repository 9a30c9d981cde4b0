/*
 * Limits through the drop-in libibverbs.so.1: every limit reached is an errno from the verb that
 * cannot be served (never a hang: an alarm ends the program), and repeated device listing and
 * opening does not grow memory. The caller sets SOFTVERBS_LIMITS for each mode:
 *
 *   limits objects   max_pd=2,max_cq=2,max_qp=2,max_mr=2,max_mw=1,max_srq=1,max_ah=1,
 *                    max_cqe=64,max_qp_wr=32,max_sge=2,max_mcast_grp=1,max_mcast_qp_attach=1
 *                    objects beyond each limit; queues and shared receive queues past their
 *                    depth; descriptors exhausted (RLIMIT_NOFILE);
 *   limits qpn       max_qp=70000: QP numbers of the process exhausted (65,519), then one freed;
 *   limits listing   no limits: 40,000 device listings and 2,000 opens, resident set flat.
 *
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "check.h"

#define ERRNO_SENTINEL 12345
/* A verb that returns NULL failed and left `want` in errno. */
#define CHECK_NULL_ERR(call, want, what)                                                        \
	do {                                                                                    \
		errno = ERRNO_SENTINEL;                                                         \
		int null_ = (call) == NULL;                                                     \
		int e_ = errno;                                                                 \
		CHECK(null_ && e_ == (want), "%s: NULL and errno %d (want %d)", what, e_, (want)); \
	} while (0)
/* A verb that returns an errno value failed with `want`. */
#define CHECK_RET(call, want, what)                                                             \
	do {                                                                                    \
		int r_ = (call);                                                                \
		CHECK(r_ == (want), "%s: returns %d (want %d)", what, r_, (want));              \
	} while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static int gid_index = -1;
static union ibv_gid gid;

static void hung(int sig)
{
	(void)sig;
	static const char msg[] = "not ok - a verb did not return within the alarm\n";
	if (write(1, msg, sizeof(msg) - 1) < 0)
		_exit(3);
	_exit(2);
}

static struct ibv_device *find_lo(struct ibv_device **list, int num)
{
	for (int i = 0; i < num; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "sv_lo"))
			return list[i];
	return NULL;
}

static void open_lo(void)
{
	int num = 0;
	struct ibv_device **list = ibv_get_device_list(&num);
	struct ibv_device *dev = list ? find_lo(list, num) : NULL;
	REQUIRE(dev, "sv_lo is listed");
	ctx = ibv_open_device(dev);
	ibv_free_device_list(list);
	REQUIRE(ctx, "ibv_open_device");
	pd = ibv_alloc_pd(ctx);
	REQUIRE(pd, "ibv_alloc_pd");
	for (int i = 0; i < 16 && gid_index < 0; i++) {
		union ibv_gid g;
		if (ibv_query_gid(ctx, 1, i, &g) == 0 && g.raw[10] == 0xff && g.raw[11] == 0xff &&
		    g.raw[12] == 127) {
			gid = g;
			gid_index = i;
		}
	}
	REQUIRE(gid_index >= 0, "sv_lo has the GID of 127.0.0.1");
}

static struct ibv_qp *make_qp(struct ibv_cq *cq, enum ibv_qp_type type, uint32_t wr)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .qp_type = type,
		.cap = { .max_send_wr = wr, .max_recv_wr = wr, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return ibv_create_qp(pd, &a);
}

static void to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11111111 };
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0,
		"UD QP to INIT");
}

static long rss_kib(void)
{
	FILE *f = fopen("/proc/self/statm", "r");
	long size = 0, resident = 0;
	if (!f || fscanf(f, "%ld %ld", &size, &resident) != 2)
		resident = -1;
	if (f)
		fclose(f);
	return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

static void objects(void)
{
	struct ibv_device_attr da;
	REQUIRE(ibv_query_device(ctx, &da) == 0, "ibv_query_device");
	CHECK(da.max_pd == 2 && da.max_cq == 2 && da.max_qp == 2 && da.max_mr == 2 && da.max_mw == 1 &&
		      da.max_srq == 1 && da.max_ah == 1 && da.max_cqe == 64 && da.max_qp_wr == 32,
	      "ibv_query_device reports the limits set");

	CHECK(ibv_alloc_pd(ctx) != NULL, "the second PD");
	CHECK_NULL_ERR(ibv_alloc_pd(ctx), ENOMEM, "a PD beyond max_pd");

	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	REQUIRE(cq, "a CQ of max_cqe entries");
	CHECK_NULL_ERR(ibv_create_cq(ctx, 65, NULL, NULL, 0), EINVAL, "a CQ beyond max_cqe");
	struct ibv_cq *cq2 = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	CHECK(cq2 != NULL, "the second CQ");
	CHECK_NULL_ERR(ibv_create_cq(ctx, 4, NULL, NULL, 0), ENOMEM, "a CQ beyond max_cq");

	static char buf[3][4096];
	CHECK(ibv_reg_mr(pd, buf[0], sizeof(buf[0]), IBV_ACCESS_LOCAL_WRITE) != NULL, "the first MR");
	struct ibv_mr *mr = ibv_reg_mr(pd, buf[1], sizeof(buf[1]), IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "the second MR");
	CHECK_NULL_ERR(ibv_reg_mr(pd, buf[2], sizeof(buf[2]), IBV_ACCESS_LOCAL_WRITE), ENOMEM,
		       "an MR beyond max_mr");
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_2) != NULL, "the first MW");
	CHECK_NULL_ERR(ibv_alloc_mw(pd, IBV_MW_TYPE_2), ENOMEM, "an MW beyond max_mw");

	CHECK_NULL_ERR(make_qp(cq, IBV_QPT_RC, 33), EINVAL, "a QP deeper than max_qp_wr");
	struct ibv_qp *qp = make_qp(cq, IBV_QPT_UD, 2);
	REQUIRE(qp, "a UD QP of depth 2");
	struct ibv_qp *rc = make_qp(cq2, IBV_QPT_RC, 2);
	CHECK(rc != NULL, "the second QP");
	CHECK_NULL_ERR(make_qp(cq, IBV_QPT_RC, 2), ENOMEM, "a QP beyond max_qp");

	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 2, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sa);
	REQUIRE(srq, "an SRQ");
	CHECK_NULL_ERR(ibv_create_srq(pd, &sa), ENOMEM, "an SRQ beyond max_srq");

	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
				  .grh = { .dgid = gid, .sgid_index = gid_index, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	REQUIRE(ah, "an AH");
	CHECK_NULL_ERR(ibv_create_ah(pd, &aa), ENOMEM, "an AH beyond max_ah");

	/* Queues past their depth: the post fails at once with ENOMEM and names the WR. */
	to_init(qp);
	struct ibv_sge sge = { .addr = (uintptr_t)buf[1], .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad_r = NULL;
	int posted = 0;
	while (posted < 100 && ibv_post_recv(qp, &rwr, &bad_r) == 0)
		posted++;
	CHECK(posted >= 2 && posted < 100, "the receive queue holds its depth (%d)", posted);
	CHECK_RET(ibv_post_recv(qp, &rwr, &bad_r), ENOMEM, "ibv_post_recv on a full receive queue");
	CHECK(bad_r == &rwr, "bad_wr names the WR that did not fit");
	posted = 0;
	while (posted < 100 && ibv_post_srq_recv(srq, &rwr, &bad_r) == 0)
		posted++;
	CHECK(posted >= 2 && posted < 100, "the SRQ holds its depth (%d)", posted);
	CHECK_RET(ibv_post_srq_recv(srq, &rwr, &bad_r), ENOMEM, "ibv_post_srq_recv on a full SRQ");

	/*
	 * A send queue past its depth: an RC QP whose destination never answers (a UD QP), with a
	 * 4 s ACK timeout, keeps every send outstanding.
	 */
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_LOCAL_WRITE };
	REQUIRE(rc && ibv_modify_qp(rc, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						    IBV_QP_ACCESS_FLAGS) == 0, "RC QP to INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = qp->qp_num;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr = aa;
	REQUIRE(ibv_modify_qp(rc, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					      IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					      IBV_QP_MIN_RNR_TIMER) == 0, "RC QP to RTR");
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 20;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	REQUIRE(ibv_modify_qp(rc, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					      IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
		"RC QP to RTS");
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED },
			   *bad_s = NULL;
	int sent = 0, ret = 0;
	while (sent < 100 && (ret = ibv_post_send(rc, &swr, &bad_s)) == 0)
		sent++;
	CHECK(sent >= 2 && sent < 100 && ret == ENOMEM && bad_s == &swr,
	      "ibv_post_send on a full send queue: ENOMEM after %d (returned %d)", sent, ret);

	/* Multicast: one group, one QP attached to it. */
	union ibv_gid mgid = { .raw = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3 } };
	union ibv_gid mgid2 = mgid;
	mgid2.raw[15] = 4;
	CHECK(ibv_attach_mcast(qp, &mgid, 0) == 0, "a multicast attach");
	CHECK_RET(ibv_attach_mcast(qp, &mgid2, 0), ENOMEM, "a group beyond max_mcast_grp");

	/* Descriptors exhausted: a completion channel and a device open fail with EMFILE. */
	struct rlimit old, low;
	REQUIRE(getrlimit(RLIMIT_NOFILE, &old) == 0, "getrlimit");
	int num = 0;
	struct ibv_device **list = ibv_get_device_list(&num);
	struct ibv_device *dev = list ? find_lo(list, num) : NULL;
	REQUIRE(dev, "sv_lo is listed");
	int fds[4096], nfds = 0;
	low = old;
	low.rlim_cur = 256;
	REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0, "setrlimit");
	while (nfds < 4096 && (fds[nfds] = dup(0)) >= 0)
		nfds++;
	CHECK(nfds > 0 && nfds < 4096, "descriptors exhausted (%d taken)", nfds);
	CHECK_NULL_ERR(ibv_create_comp_channel(ctx), EMFILE, "ibv_create_comp_channel without descriptors");
	CHECK_NULL_ERR(ibv_open_device(dev), EMFILE, "ibv_open_device without descriptors");
	int n2 = 0;
	errno = ERRNO_SENTINEL;
	struct ibv_device **list2 = ibv_get_device_list(&n2);
	CHECK(list2 || errno == EMFILE, "ibv_get_device_list without descriptors: a list or NULL and EMFILE (errno %d)",
	      errno);
	if (list2)
		ibv_free_device_list(list2);
	ibv_free_device_list(list);
	while (nfds > 0)
		close(fds[--nfds]);
	REQUIRE(setrlimit(RLIMIT_NOFILE, &old) == 0, "setrlimit back");
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	CHECK(ch != NULL, "a completion channel once descriptors are free");
	if (ch)
		ibv_destroy_comp_channel(ch);

	/* What was refused took nothing: freeing one object makes room for one. */
	CHECK(ibv_destroy_qp(rc) == 0, "ibv_destroy_qp");
	rc = make_qp(cq2, IBV_QPT_RC, 2);
	CHECK(rc != NULL, "a QP again after one was destroyed");
	CHECK_NULL_ERR(make_qp(cq2, IBV_QPT_RC, 2), ENOMEM, "and then no more");
}

static void qpn(void)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	REQUIRE(cq, "a CQ");
	enum { MAX = 70000 };
	static struct ibv_qp *qps[MAX];
	int n = 0;
	errno = ERRNO_SENTINEL;
	while (n < MAX && (qps[n] = make_qp(cq, IBV_QPT_UD, 1)) != NULL)
		n++;
	int e = errno;
	CHECK(n == 0xFFFF - 0x11 + 1 && e == ENOMEM,
	      "QP numbers exhausted: %d QPs (want 65519), then NULL and errno %d (want ENOMEM)", n, e);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 2, .max_sge = 1 } };
	CHECK_NULL_ERR(ibv_create_srq(pd, &sa), ENOMEM, "an SRQ once QP numbers are exhausted");
	if (n > 0) {
		CHECK(ibv_destroy_qp(qps[--n]) == 0, "ibv_destroy_qp");
		qps[n] = make_qp(cq, IBV_QPT_UD, 1);
		CHECK(qps[n] != NULL, "a freed number is used again");
		if (qps[n])
			n++;
		CHECK_NULL_ERR(make_qp(cq, IBV_QPT_UD, 1), ENOMEM, "and then no more");
	}
	int failed = 0;
	while (n > 0)
		failed += ibv_destroy_qp(qps[--n]) != 0;
	CHECK(failed == 0, "every QP destroyed");
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
}

static void listing(void)
{
	/* Warm the allocator's pools first; then the resident set must stay where it is. */
	for (int round = 0; round < 2; round++) {
		long before = rss_kib();
		int bad = 0;
		for (int i = 0; i < 20000; i++) {
			int num = 0;
			struct ibv_device **list = ibv_get_device_list(&num);
			bad += !list || num < 1;
			if (list)
				ibv_free_device_list(list);
		}
		for (int i = 0; i < 1000; i++) {
			int num = 0;
			struct ibv_device **list = ibv_get_device_list(&num);
			struct ibv_device *dev = list ? find_lo(list, num) : NULL;
			struct ibv_context *c = dev ? ibv_open_device(dev) : NULL;
			bad += !c;
			if (c)
				bad += ibv_close_device(c) != 0;
			if (list)
				ibv_free_device_list(list);
		}
		long grown = rss_kib() - before;
		if (round == 0)
			printf("# warm-up round: resident set %ld KiB -> %+ld KiB\n", before, grown);
		else
			CHECK(bad == 0 && grown < 2048,
			      "20,000 device listings and 1,000 opens: resident set %ld KiB, grew %ld KiB (%d failed)",
			      before, grown, bad);
	}
}

int main(int argc, char **argv)
{
	const char *mode = argc > 1 ? argv[1] : "";
	signal(SIGALRM, hung);
	alarm(120);
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (!strcmp(mode, "listing")) {
		listing();
	} else {
		open_lo();
		if (!strcmp(mode, "objects"))
			objects();
		else if (!strcmp(mode, "qpn"))
			qpn();
		else
			CHECK(0, "unknown mode %s", mode);
	}
	printf("%d failed\n", failures);
	return failures != 0;
}

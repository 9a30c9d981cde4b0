/*
 * Conformance checks of the drop-in libibverbs.so.1 through the real <infiniband/verbs.h>:
 * return and errno conventions of the man pages, the inline wrappers (ops table and
 * verbs_context), completion events, the extended CQ and QP APIs, SRQs, UD address handles and
 * async events, tag-matching SRQs. All traffic is between QPs of this process on device sv_lo.
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/tm_types.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size);

#include "check.h"

/*
 * A verb that returns an errno value failed with `want` and left the same value in errno, as
 * rdma-core does; errno is set to a sentinel first so that a stale value cannot pass.
 */
#define ERRNO_SENTINEL 12345
#define CHECK_ERR(call, want, what)                                                             \
	do {                                                                                    \
		errno = ERRNO_SENTINEL;                                                         \
		int r_ = (call);                                                                \
		int e_ = errno;                                                                 \
		CHECK(r_ == (want) && e_ == (want), "%s: returns %d and errno %d (want %d)", what, r_, \
		      e_, (want));                                                              \
	} while (0)
/* A verb that returns NULL (or -1) failed and left `want` in errno. */
#define CHECK_NULL_ERR(call, want, what)                                                        \
	do {                                                                                    \
		errno = ERRNO_SENTINEL;                                                         \
		int null_ = (call) == NULL;                                                     \
		int e_ = errno;                                                                 \
		CHECK(null_ && e_ == (want), "%s: NULL and errno %d (want %d)", what, e_, (want)); \
	} while (0)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static int gid_index = -1;
static union ibv_gid gid;

static struct ibv_qp *make_qp(struct ibv_cq *cq, enum ibv_qp_type type, struct ibv_srq *srq)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = type,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2,
			 .max_recv_sge = 2, .max_inline_data = 64 },
	};
	return ibv_create_qp(pd, &a);
}

static int connect_qp(struct ibv_qp *qp, uint32_t remote_qpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_REMOTE_ATOMIC, .qkey = 0x11111111 };
	int ud = qp->qp_type == IBV_QPT_UD;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  (ud ? IBV_QP_QKEY : IBV_QP_ACCESS_FLAGS)))
		return -1;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	int mask = IBV_QP_STATE;
	if (!ud) {
		a.path_mtu = IBV_MTU_1024;
		a.dest_qp_num = remote_qpn;
		a.rq_psn = 0;
		a.max_dest_rd_atomic = 4;
		a.min_rnr_timer = 12;
		a.ah_attr.is_global = 1;
		a.ah_attr.grh.dgid = gid;
		a.ah_attr.grh.sgid_index = gid_index;
		a.ah_attr.grh.hop_limit = 1;
		a.ah_attr.port_num = 1;
		mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
		if (qp->qp_type == IBV_QPT_RC)
			mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	}
	if (ibv_modify_qp(qp, &a, mask))
		return -1;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
	if (qp->qp_type == IBV_QPT_RC) {
		a.timeout = 14;
		a.retry_cnt = 7;
		a.rnr_retry = 7;
		a.max_rd_atomic = 4;
		mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
	}
	return ibv_modify_qp(qp, &a, mask);
}

static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
	for (int i = 0; i < 2000000; i++) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n)
			return n;
	}
	return 0;
}

static void test_device_and_queries(void)
{
	int num = -1;
	struct ibv_device **list = ibv_get_device_list(&num);
	REQUIRE(list && num > 0 && list[num] == NULL, "ibv_get_device_list returns a NULL-terminated list");
	struct ibv_device *dev = NULL;
	for (int i = 0; i < num; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "sv_lo"))
			dev = list[i];
	REQUIRE(dev, "sv_lo is listed");
	CHECK(dev->node_type == IBV_NODE_CA && dev->transport_type == IBV_TRANSPORT_IB, "node and transport type");
	CHECK(ibv_get_device_guid(dev) != 0, "ibv_get_device_guid");
	CHECK(ibv_get_device_index(dev) > 0, "ibv_get_device_index");
	ibv_free_device_list(list);
	CHECK(!strcmp(ibv_get_device_name(dev), "sv_lo"), "devices outlive the list");

	ctx = ibv_open_device(dev);
	REQUIRE(ctx, "ibv_open_device");
	struct verbs_context *vctx = verbs_get_ctx(ctx);
	CHECK(vctx && vctx->sz == sizeof(struct verbs_context), "verbs_context with sz %zu", vctx ? vctx->sz : 0);
	CHECK(ctx->async_fd >= 0 && fcntl(ctx->async_fd, F_GETFL) >= 0, "async_fd is a real fd");
	CHECK(ctx->num_comp_vectors >= 1, "num_comp_vectors");

	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE &&
		      pa.link_layer == IBV_LINK_LAYER_ETHERNET, "ibv_query_port (inline, verbs_context op)");
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL, "ibv_query_port on port 2 is EINVAL");
	unsigned char buf[sizeof(struct ibv_port_attr)];
	memset(buf, 0xAB, sizeof(buf));
	CHECK((ibv_query_port)(ctx, 1, (struct _compat_ibv_port_attr *)buf) == 0 &&
		      buf[48] == 0xAB && buf[49] == 0xAB && buf[50] == 0xAB && buf[51] == 0xAB,
	      "exported ibv_query_port writes at most 48 bytes");

	struct ibv_device_attr_ex dx = { 0 };
	CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.orig_attr.phys_port_cnt == 1 &&
		      dx.orig_attr.max_qp > 0, "ibv_query_device_ex");
	struct ibv_query_device_ex_input in = { .comp_mask = 1 };
	CHECK(ibv_query_device_ex(ctx, &in, &dx) == EINVAL, "ibv_query_device_ex with comp_mask is EINVAL");
	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0 && da.max_cqe > 0, "ibv_query_device");

	for (int i = 0; i < pa.gid_tbl_len; i++) {
		union ibv_gid g;
		if (ibv_query_gid(ctx, 1, i, &g) == 0 && g.raw[10] == 0xff && g.raw[11] == 0xff &&
		    g.raw[12] == 127 && g.raw[15] == 1) {
			gid_index = i;
			gid = g;
			break;
		}
	}
	REQUIRE(gid_index >= 0, "::ffff:127.0.0.1 is in the GID table (index %d)", gid_index);
	errno = 0;
	CHECK(ibv_query_gid(ctx, 1, 100000, &gid) == -1 && errno == EINVAL, "ibv_query_gid out of range: -1, EINVAL");
	struct ibv_gid_entry ge;
	CHECK(ibv_query_gid_ex(ctx, 1, gid_index, &ge, 0) == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2 &&
		      !memcmp(&ge.gid, &gid, 16), "ibv_query_gid_ex");
	struct ibv_gid_entry table[64];
	CHECK(ibv_query_gid_table(ctx, table, 64, 0) >= 1, "ibv_query_gid_table");
	__be16 pkey = 0;
	CHECK(ibv_query_pkey(ctx, 1, 0, &pkey) == 0 && pkey == htobe16(0xffff), "ibv_query_pkey");
	CHECK(ibv_get_pkey_index(ctx, 1, htobe16(0xffff)) == 0, "ibv_get_pkey_index");
	char sysfs[64];
	CHECK(ibv_read_sysfs_file(dev->ibdev_path, "board_id", sysfs, sizeof(sysfs)) == -1,
	      "ibv_read_sysfs_file fails gracefully");
	CHECK(ibv_fork_init() == 0 && ibv_is_fork_initialized() == IBV_FORK_UNNEEDED, "fork helpers");
	CHECK(!strcmp(ibv_wc_status_str(IBV_WC_SUCCESS), "success"), "ibv_wc_status_str");
	CHECK(ibv_rate_to_mbps(IBV_RATE_10_GBPS) == 10000, "ibv_rate_to_mbps");
}

static void test_rc_and_events(void)
{
	pd = ibv_alloc_pd(ctx);
	REQUIRE(pd && pd->context == ctx, "ibv_alloc_pd");
	char *mem = calloc(1, 4096);
	errno = 0;
	CHECK(!ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_REMOTE_WRITE) && errno == EINVAL,
	      "remote write without local write: NULL, EINVAL");
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				      IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	REQUIRE(mr && mr->addr == mem && mr->length == 4096 && mr->lkey != mr->rkey, "ibv_reg_mr");

	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	REQUIRE(ch && ch->fd >= 0, "ibv_create_comp_channel has a real fd");
	errno = 0;
	CHECK(!ibv_create_cq(ctx, 0, NULL, NULL, 0) && errno == EINVAL, "ibv_create_cq with cqe 0: NULL, EINVAL");
	struct ibv_cq *cq = ibv_create_cq(ctx, 32, (void *)0x1234, ch, 0);
	REQUIRE(cq && cq->cqe >= 32 && cq->channel == ch, "ibv_create_cq");
	CHECK(ch->refcnt == 1, "the channel counts its CQs in refcnt");
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "ibv_destroy_comp_channel while used: EBUSY");

	struct ibv_qp *a = make_qp(cq, IBV_QPT_RC, NULL), *b = make_qp(cq, IBV_QPT_RC, NULL);
	REQUIRE(a && b && a->qp_num != b->qp_num && a->state == IBV_QPS_RESET, "two RC QPs");
	REQUIRE(connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0, "RC QPs to RTS");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK(ibv_query_qp(a, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RTS &&
		      a->state == IBV_QPS_RTS && qi.send_cq == cq, "ibv_query_qp");
	CHECK(ibv_dealloc_pd(pd) == EBUSY, "ibv_dealloc_pd while used: EBUSY");
	CHECK(ibv_query_qp_data_in_order(a, IBV_WR_SEND, 0) != 0, "ibv_query_qp_data_in_order");

	/* An inline send: the buffer may change right after posting. */
	struct ibv_sge rs = { .addr = (uintptr_t)mem + 1024, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 2, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	REQUIRE(ibv_post_recv(b, &rwr, &bad_r) == 0, "ibv_post_recv");
	CHECK(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	char msg[16] = "hello, inline";
	struct ibv_sge ss = { .addr = (uintptr_t)msg, .length = sizeof(msg), .lkey = 0 };
	struct ibv_send_wr swr = { .wr_id = 1, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED }, *bad_s;
	REQUIRE(ibv_post_send(a, &swr, &bad_s) == 0, "ibv_post_send inline");
	memset(msg, 0, sizeof(msg));
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx = NULL;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq && ev_ctx == (void *)0x1234,
	      "ibv_get_cq_event returns the CQ and its context");
	ibv_ack_cq_events(cq, 1);
	CHECK(cq->comp_events_completed == 1, "ibv_ack_cq_events counts in cq->comp_events_completed");
	struct ibv_wc wc[2];
	int got = 0, recv_ok = 0;
	for (int i = 0; i < 2 && (got = poll_one(cq, &wc[0])); i++)
		if (wc[0].opcode == IBV_WC_RECV && wc[0].status == IBV_WC_SUCCESS && wc[0].byte_len == 16 &&
		    !strcmp(mem + 1024, "hello, inline"))
			recv_ok = 1;
	CHECK(recv_ok, "the receive completes with the inline data");
	fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
	errno = 0;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN,
	      "ibv_get_cq_event on a non-blocking channel: -1, EAGAIN");

	swr.opcode = 77;
	swr.send_flags = IBV_SEND_SIGNALED;
	bad_s = NULL;
	CHECK(ibv_post_send(a, &swr, &bad_s) == EINVAL && bad_s == &swr, "a bad opcode: EINVAL and bad_wr");

	/* RDMA write and read through ibv_post_send. */
	strcpy(mem, "written remotely");
	struct ibv_sge ws = { .addr = (uintptr_t)mem, .length = 17, .lkey = mr->lkey };
	struct ibv_send_wr w = { .wr_id = 3, .sg_list = &ws, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED,
				 .wr.rdma = { .remote_addr = (uintptr_t)mem + 2048, .rkey = mr->rkey } };
	CHECK(ibv_post_send(a, &w, &bad_s) == 0 && poll_one(cq, wc) && wc[0].status == IBV_WC_SUCCESS &&
		      wc[0].opcode == IBV_WC_RDMA_WRITE && !strcmp(mem + 2048, "written remotely"),
	      "RDMA WRITE");

	uint32_t old_rkey = mr->rkey, old_lkey = mr->lkey;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE) == 0 &&
		      mr->rkey == old_rkey && mr->lkey == old_lkey && mr->addr == mem,
	      "ibv_rereg_mr changes the access and keeps the keys");
	w.wr.rdma.rkey = mr->rkey;
	ws.lkey = mr->lkey;
	CHECK(ibv_post_send(a, &w, &bad_s) == 0 && poll_one(cq, wc) && wc[0].status == IBV_WC_REM_ACCESS_ERR,
	      "a write to the re-registered read-only region fails with a remote access error");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, 0, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
	      "ibv_rereg_mr without flags: IBV_REREG_MR_ERR_INPUT, EINVAL");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "ibv_destroy_qp");
	CHECK(ibv_destroy_cq(cq) == 0 && ibv_destroy_comp_channel(ch) == 0, "ibv_destroy_cq, channel");
	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr");
	free(mem);
}

/* Two fresh RC QPs of `pd` on `cq`, connected to each other. */
static void rc_pair(struct ibv_cq *cq, struct ibv_qp **a, struct ibv_qp **b)
{
	*a = make_qp(cq, IBV_QPT_RC, NULL);
	*b = make_qp(cq, IBV_QPT_RC, NULL);
	REQUIRE(*a && *b && connect_qp(*a, (*b)->qp_num) == 0 && connect_qp(*b, (*a)->qp_num) == 0,
		"RC QP pair to RTS");
}

/* Posts one signaled WR on `qp` and polls its completion into `wc`. */
static int post_and_poll(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_cq *cq, struct ibv_wc *wc)
{
	struct ibv_send_wr *bad;
	wr->send_flags |= IBV_SEND_SIGNALED;
	return ibv_post_send(qp, wr, &bad) == 0 && poll_one(cq, wc) == 1;
}

static void test_memory_windows(void)
{
	struct ibv_device_attr da;
	REQUIRE(ibv_query_device(ctx, &da) == 0, "ibv_query_device");
	CHECK(da.max_mw > 0 && (da.device_cap_flags & IBV_DEVICE_MEM_WINDOW) &&
		      (da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B),
	      "max_mw > 0 and IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B");
	char *mem = calloc(1, 8192), *src = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	REQUIRE(mr && smr && cq, "memory window setup");
	struct ibv_qp *a, *b;
	struct ibv_wc wc;
	struct ibv_send_wr *bad;
	rc_pair(cq, &a, &b);

	/* Type 2: allocated free, bound by IBV_WR_BIND_MW, used, invalidated by LOCAL_INV. */
	struct ibv_mw *mw2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	REQUIRE(mw2 && mw2->pd == pd && mw2->context == ctx && mw2->type == IBV_MW_TYPE_2, "ibv_alloc_mw type 2");
	CHECK_NULL_ERR(ibv_alloc_mw(pd, 3), EINVAL, "ibv_alloc_mw of an unknown type");
	uint32_t rkey2 = ibv_inc_rkey(mw2->rkey);
	CHECK(rkey2 >> 8 == mw2->rkey >> 8 && rkey2 != mw2->rkey, "ibv_inc_rkey changes only the tag");
	struct ibv_send_wr bw = {
		.wr_id = 1, .opcode = IBV_WR_BIND_MW,
		.bind_mw = { .mw = mw2, .rkey = rkey2,
			     .bind_info = { .mr = mr, .addr = (uintptr_t)mem + 4096, .length = 4096,
					    .mw_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ } },
	};
	CHECK(post_and_poll(b, &bw, cq, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW &&
		      wc.wr_id == 1, "IBV_WR_BIND_MW completes with IBV_WC_BIND_MW");
	CHECK_ERR(ibv_dereg_mr(mr), EBUSY, "ibv_dereg_mr while a window is bound");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND | IBV_ACCESS_REMOTE_READ) ==
			      IBV_REREG_MR_ERR_CMD && errno == EBUSY,
	      "ibv_rereg_mr while a window is bound: IBV_REREG_MR_ERR_CMD, EBUSY");
	strcpy(src, "through the window");
	struct ibv_sge s = { .addr = (uintptr_t)src, .length = 19, .lkey = smr->lkey };
	struct ibv_send_wr w = { .wr_id = 2, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .wr.rdma = { .remote_addr = (uintptr_t)mem + 4196, .rkey = rkey2 } };
	CHECK(post_and_poll(a, &w, cq, &wc) && wc.status == IBV_WC_SUCCESS && !strcmp(mem + 4196, "through the window"),
	      "RDMA WRITE through a bound type 2 window");
	struct ibv_send_wr r = { .wr_id = 3, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
				 .wr.rdma = { .remote_addr = (uintptr_t)mem + 4196, .rkey = rkey2 } };
	memset(src, 0, 32);
	CHECK(post_and_poll(a, &r, cq, &wc) && wc.status == IBV_WC_SUCCESS && !strcmp(src, "through the window"),
	      "RDMA READ through a bound type 2 window");
	struct ibv_send_wr inv = { .wr_id = 4, .opcode = IBV_WR_LOCAL_INV, .invalidate_rkey = rkey2 };
	CHECK(post_and_poll(b, &inv, cq, &wc) && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_LOCAL_INV,
	      "IBV_WR_LOCAL_INV completes with IBV_WC_LOCAL_INV");
	strcpy(src, "stale!!");  /* must not reach the peer */
	w.wr_id = 5;
	CHECK(post_and_poll(a, &w, cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR &&
		      !strcmp(mem + 4196, "through the window"),
	      "a WRITE after LOCAL_INV: IBV_WC_REM_ACCESS_ERR, memory untouched");
	CHECK(ibv_dereg_mr(smr) == 0 && (smr = ibv_reg_mr(pd, src, 4096, IBV_ACCESS_LOCAL_WRITE)),
	      "regions without windows deregister");
	s.lkey = smr->lkey;
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* SEND with Invalidate frees the window before the receive completes. */
	rc_pair(cq, &a, &b);
	bw.bind_mw.rkey = rkey2 = ibv_inc_rkey(rkey2);
	CHECK(post_and_poll(b, &bw, cq, &wc) && wc.status == IBV_WC_SUCCESS, "a freed type 2 window binds again");
	struct ibv_sge rs = { .addr = (uintptr_t)mem, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 20, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	REQUIRE(ibv_post_recv(b, &rwr, &bad_r) == 0, "ibv_post_recv");
	struct ibv_send_wr si = { .wr_id = 6, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_INV,
				  .send_flags = IBV_SEND_SIGNALED,
				  .invalidate_rkey = rkey2 };
	int send_ok = 0, recv_ok = 0;
	if (ibv_post_send(a, &si, &bad) == 0)
		for (int i = 0; i < 2 && poll_one(cq, &wc); i++) {
			if (wc.wr_id == 6)
				send_ok = wc.status == IBV_WC_SUCCESS;
			if (wc.wr_id == 20)
				recv_ok = wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_INV) &&
					  wc.invalidated_rkey == rkey2;
		}
	CHECK(send_ok && recv_ok, "SEND_WITH_INV: IBV_WC_WITH_INV and invalidated_rkey in the receive");
	w.wr_id = 7;
	CHECK(post_and_poll(a, &w, cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR &&
		      !strcmp(mem + 4196, "through the window"),
	      "a WRITE after SEND_WITH_INV: IBV_WC_REM_ACCESS_ERR, memory untouched");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* Type 1: ibv_bind_mw, its inline checks, and unbinding. */
	rc_pair(cq, &a, &b);
	struct ibv_mw *mw1 = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
	REQUIRE(mw1 && mw1->type == IBV_MW_TYPE_1, "ibv_alloc_mw type 1");
	struct ibv_mw_bind mb = { .wr_id = 8, .send_flags = IBV_SEND_SIGNALED,
				  .bind_info = { .mr = mr, .addr = (uintptr_t)mem, .length = 4096,
						 .mw_access_flags = IBV_ACCESS_REMOTE_READ } };
	CHECK(ibv_bind_mw(b, mw2, &mb) == EINVAL, "ibv_bind_mw of a type 2 window: EINVAL");
	struct ibv_mw_bind nomr = mb;
	nomr.bind_info.mr = NULL;
	CHECK(ibv_bind_mw(b, mw1, &nomr) == EINVAL, "ibv_bind_mw with an address but no MR: EINVAL");
	struct ibv_pd *pd2 = ibv_alloc_pd(ctx);
	struct ibv_mr *mr_pd2 = ibv_reg_mr(pd2, src, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	struct ibv_mw_bind other = mb;
	other.bind_info.mr = mr_pd2;
	other.bind_info.addr = (uintptr_t)src;
	other.bind_info.length = 64;
	CHECK(ibv_bind_mw(b, mw1, &other) == EPERM, "ibv_bind_mw with an MR of another PD: EPERM");
	uint32_t before = mw1->rkey;
	strcpy(mem + 10, "type one");
	CHECK(ibv_bind_mw(b, mw1, &mb) == 0 && mw1->rkey == ibv_inc_rkey(before) && poll_one(cq, &wc) &&
		      wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 8,
	      "ibv_bind_mw: mw->rkey = ibv_inc_rkey(old) at post time, then IBV_WC_BIND_MW");
	r.wr.rdma.remote_addr = (uintptr_t)mem + 10;
	r.wr.rdma.rkey = mw1->rkey;
	r.wr_id = 9;
	memset(src, 0, 16);
	CHECK(post_and_poll(a, &r, cq, &wc) && wc.status == IBV_WC_SUCCESS && !strcmp(src, "type one"),
	      "RDMA READ through a type 1 window");
	struct ibv_send_wr inv1 = { .wr_id = 10, .opcode = IBV_WR_LOCAL_INV, .invalidate_rkey = mw1->rkey };
	CHECK(post_and_poll(b, &inv1, cq, &wc) && wc.status == IBV_WC_LOC_QP_OP_ERR && wc.opcode == IBV_WC_LOCAL_INV,
	      "LOCAL_INV of a type 1 window: IBV_WC_LOC_QP_OP_ERR");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	rc_pair(cq, &a, &b);
	struct ibv_mw_bind unbind = { .wr_id = 11, .send_flags = IBV_SEND_SIGNALED };
	CHECK(ibv_bind_mw(b, mw1, &unbind) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS,
	      "ibv_bind_mw with no MR and length 0 unbinds");
	r.wr_id = 12;
	CHECK(post_and_poll(a, &r, cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR,
	      "a READ through an unbound type 1 window: IBV_WC_REM_ACCESS_ERR");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* A bind that breaks a rule: IBV_WC_MW_BIND_ERR, and the QP fails. */
	rc_pair(cq, &a, &b);
	bw.bind_mw.rkey = rkey2 = ibv_inc_rkey(rkey2);
	bw.bind_mw.bind_info.length = 8192; /* beyond the region */
	bw.wr_id = 13;
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	CHECK(post_and_poll(b, &bw, cq, &wc) && wc.status == IBV_WC_MW_BIND_ERR &&
		      ibv_query_qp(b, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_ERR,
	      "a window beyond its region: IBV_WC_MW_BIND_ERR, QP in ERR");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* ibv_wr_bind_mw and ibv_wr_local_inv on an extended QP. */
	struct ibv_qp_init_attr_ex qx_attr = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_RDMA_WRITE,
	};
	a = ibv_create_qp_ex(ctx, &qx_attr);
	b = ibv_create_qp_ex(ctx, &qx_attr);
	REQUIRE(a && b && connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0,
		"extended QPs with IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(b);
	struct ibv_mw_bind_info bi = { .mr = mr, .addr = (uintptr_t)mem, .length = 128,
				       .mw_access_flags = IBV_ACCESS_REMOTE_WRITE };
	rkey2 = ibv_inc_rkey(rkey2);
	ibv_wr_start(qx);
	qx->wr_id = 14;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(qx, mw2, rkey2, &bi);
	CHECK(ibv_wr_complete(qx) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      wc.opcode == IBV_WC_BIND_MW && wc.wr_id == 14,
	      "ibv_wr_bind_mw");
	w.wr_id = 15;
	w.wr.rdma.remote_addr = (uintptr_t)mem + 64;
	w.wr.rdma.rkey = rkey2;
	strcpy(src, "wr api");
	CHECK(post_and_poll(a, &w, cq, &wc) && wc.status == IBV_WC_SUCCESS && !strcmp(mem + 64, "wr api"),
	      "RDMA WRITE through a window bound by ibv_wr_bind_mw");
	ibv_wr_start(qx);
	qx->wr_id = 16;
	ibv_wr_local_inv(qx, rkey2);
	CHECK(ibv_wr_complete(qx) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      wc.opcode == IBV_WC_LOCAL_INV && wc.wr_id == 16,
	      "ibv_wr_local_inv");
	strcpy(src, "stale");  /* must not reach the peer */
	w.wr_id = 17;
	CHECK(post_and_poll(a, &w, cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR && !strcmp(mem + 64, "wr api"),
	      "a WRITE after ibv_wr_local_inv: IBV_WC_REM_ACCESS_ERR");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* Deallocating a bound window unbinds it. */
	rc_pair(cq, &a, &b);
	CHECK(ibv_bind_mw(b, mw1, &mb) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS,
	      "type 1 window bound again");
	CHECK_ERR(ibv_dereg_mr(mr), EBUSY, "ibv_dereg_mr with a bound type 1 window");
	CHECK(ibv_dealloc_mw(mw1) == 0 && ibv_dealloc_mw(mw2) == 0, "ibv_dealloc_mw of bound and free windows");
	CHECK(ibv_dereg_mr(mr) == 0, "ibv_dereg_mr once the windows are gone");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_dereg_mr(mr_pd2);
	ibv_dealloc_pd(pd2);
	ibv_dereg_mr(smr);
	ibv_destroy_cq(cq);
	free(mem);
	free(src);
}

/* RC traffic after each kind of ibv_rereg_mr, and its errors. */
static void test_rereg(void)
{
	char *mem = calloc(1, 4096), *mem2 = calloc(1, 8192), *src = calloc(1, 64);
	struct ibv_pd *pd2 = ibv_alloc_pd(ctx);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, 64, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mr = ibv_reg_mr(pd2, mem, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	REQUIRE(pd2 && smr && mr && cq, "rereg setup");
	struct ibv_qp *a, *b;
	struct ibv_wc wc;
	rc_pair(cq, &a, &b);
	uint32_t lkey = mr->lkey, rkey = mr->rkey;

	errno = 0;
	CHECK(ibv_rereg_mr(mr, 8, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT && errno == EINVAL,
	      "ibv_rereg_mr with an unknown flag: IBV_REREG_MR_ERR_INPUT, EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, 4096, 0) == IBV_REREG_MR_ERR_INPUT &&
		      errno == EINVAL,
	      "IBV_REREG_MR_CHANGE_TRANSLATION with a NULL address: IBV_REREG_MR_ERR_INPUT, EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, NULL, NULL, 0, 0) == IBV_REREG_MR_ERR_INPUT &&
		      errno == EINVAL,
	      "IBV_REREG_MR_CHANGE_PD with a NULL PD: IBV_REREG_MR_ERR_INPUT, EINVAL");
	errno = 0;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_REMOTE_WRITE) ==
			      IBV_REREG_MR_ERR_CMD && errno == EINVAL,
	      "remote write without local write: IBV_REREG_MR_ERR_CMD, EINVAL");

	struct ibv_sge s = { .addr = (uintptr_t)src, .length = 8, .lkey = smr->lkey };
	struct ibv_send_wr w = { .wr_id = 1, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				 .send_flags = IBV_SEND_SIGNALED,
				 .wr.rdma = { .remote_addr = (uintptr_t)mem, .rkey = rkey } }, *bad;
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS, pd, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == 0 &&
		      mr->pd == pd && mr->lkey == lkey && mr->rkey == rkey,
	      "ibv_rereg_mr of PD and access keeps the keys");
	strcpy(src, "rereg 1");
	CHECK(ibv_post_send(a, &w, &bad) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      !strcmp(mem, "rereg 1"),
	      "RC WRITE after changing PD and access");
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, mem2, 8192, 0) == 0 && mr->addr == mem2 &&
		      mr->length == 8192 && mr->rkey == rkey,
	      "ibv_rereg_mr of the translation keeps the keys");
	strcpy(src, "rereg 2");
	w.wr.rdma.remote_addr = (uintptr_t)mem2 + 6000;
	CHECK(ibv_post_send(a, &w, &bad) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      !strcmp(mem2 + 6000, "rereg 2") && !strcmp(mem, "rereg 1"),
	      "RC WRITE after changing the translation lands in the new memory");
	CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0,
	      "ibv_rereg_mr of the access to read-only");
	struct ibv_send_wr r = w;
	r.opcode = IBV_WR_RDMA_READ;
	r.wr_id = 2;
	memset(src, 0, 8);
	CHECK(ibv_post_send(a, &r, &bad) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      !strcmp(src, "rereg 2"),
	      "RC READ after changing the access");
	w.wr_id = 3;
	CHECK(ibv_post_send(a, &w, &bad) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR,
	      "RC WRITE to the now read-only region: IBV_WC_REM_ACCESS_ERR");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(smr) == 0 &&
		      ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd2) == 0,
	      "rereg teardown");
	free(mem);
	free(mem2);
	free(src);
}

static void test_extended_apis(void)
{
	uint64_t *mem = aligned_alloc(4096, 4096);
	memset(mem, 0, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				      IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	struct ibv_cq_init_attr_ex cqa = { .cqe = 64, .wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM };
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cqa);
	REQUIRE(cqx, "ibv_create_cq_ex");
	struct ibv_cq_init_attr_ex bad_cqa = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_CVLAN };
	errno = 0;
	CHECK(!ibv_create_cq_ex(ctx, &bad_cqa) && errno == EOPNOTSUPP, "VLAN info: EOPNOTSUPP");
	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);

	struct ibv_qp_init_attr_ex qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1,
			 .max_inline_data = 32 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ |
				  IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
				  IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
	};
	struct ibv_qp *a = ibv_create_qp_ex(ctx, &qa);
	struct ibv_qp *b = ibv_create_qp_ex(ctx, &qa);
	REQUIRE(a && b, "ibv_create_qp_ex with send_ops_flags");
	REQUIRE(connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0, "extended QPs to RTS");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(a);
	REQUIRE(qx, "ibv_qp_to_qp_ex");

	struct ibv_sge rs = { .addr = (uintptr_t)&mem[100], .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 50, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	ibv_post_recv(b, &rwr, &bad_r);
	rwr.wr_id = 51;
	ibv_post_recv(b, &rwr, &bad_r);

	mem[0] = 40;
	mem[1] = 7;
	mem[2] = 5;
	ibv_wr_start(qx);
	qx->wr_id = 10;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_fetch_add(qx, mr->rkey, (uintptr_t)&mem[0], 2);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&mem[10], 8);
	qx->wr_id = 11;
	ibv_wr_atomic_cmp_swp(qx, mr->rkey, (uintptr_t)&mem[1], 7, 99);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&mem[11], 8);
	qx->wr_id = 12;
	ibv_wr_rdma_read(qx, mr->rkey, (uintptr_t)&mem[0]);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&mem[12], 8);
	qx->wr_id = 13;
	qx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send(qx);
	ibv_wr_set_inline_data(qx, "inline via wr", 14);
	qx->wr_id = 14;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write_imm(qx, mr->rkey, (uintptr_t)&mem[200], htobe32(0xabcd));
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&mem[2], 8);
	CHECK(ibv_wr_complete(qx) == 0, "ibv_wr_complete posts five work requests");

	int seen = 0, ok = 1, polled = 0;
	struct ibv_poll_cq_attr pa = {};
	for (int spin = 0; spin < 2000000 && polled < 7; spin++) {
		if (ibv_start_poll(cqx, &pa))
			continue;
		do {
			polled++;
			if (cqx->status != IBV_WC_SUCCESS)
				ok = 0;
			if (cqx->wr_id >= 10 && cqx->wr_id <= 14)
				seen |= 1 << (cqx->wr_id - 10);
			if (cqx->wr_id == 50 && (ibv_wc_read_opcode(cqx) != IBV_WC_RECV ||
						 ibv_wc_read_byte_len(cqx) != 14 || ibv_wc_read_qp_num(cqx) != b->qp_num))
				ok = 0;
			if (cqx->wr_id == 51 && (ibv_wc_read_opcode(cqx) != IBV_WC_RECV_RDMA_WITH_IMM ||
						 !(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM) ||
						 ibv_wc_read_imm_data(cqx) != htobe32(0xabcd)))
				ok = 0;
		} while (ibv_next_poll(cqx) == 0);
		ibv_end_poll(cqx);
	}
	CHECK(ok && seen == 0x1f && polled == 7, "start_poll/next_poll/read_* see all 7 completions");
	CHECK(mem[10] == 40 && mem[11] == 7 && mem[12] == 42 && mem[1] == 99 && mem[200] == 5,
	      "fetch_add, cmp_swp, read and write_imm results (%lu %lu %lu %lu %lu)",
	      (unsigned long)mem[10], (unsigned long)mem[11], (unsigned long)mem[12], (unsigned long)mem[1],
	      (unsigned long)mem[200]);
	CHECK(!strcmp((char *)&mem[100], "inline via wr"), "inline data via ibv_wr_set_inline_data");

	/* The same CQ through ibv_poll_cq. */
	ibv_wr_start(qx);
	qx->wr_id = 20;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, mr->rkey, (uintptr_t)&mem[300]);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)&mem[0], 8);
	ibv_wr_complete(qx);
	struct ibv_wc wc;
	CHECK(poll_one(cq, &wc) == 1 && wc.wr_id == 20 && wc.status == IBV_WC_SUCCESS,
	      "an ibv_cq_ex works with ibv_poll_cq");
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_xrc_srqn(qx, 5);
	CHECK(ibv_wr_complete(qx) == EINVAL, "ibv_wr_set_xrc_srqn on an RC QP: EINVAL at wr_complete");
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_abort(qx);

	/* SRQs: ibv_create_srq_ex, the limit event and non-blocking async events. */
	struct ibv_srq_init_attr_ex sa = { .attr = { .max_wr = 8, .max_sge = 1 },
					   .comp_mask = IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_TYPE,
					   .srq_type = IBV_SRQT_BASIC, .pd = pd };
	struct ibv_srq *srq = ibv_create_srq_ex(ctx, &sa);
	REQUIRE(srq && sa.attr.max_wr >= 8, "ibv_create_srq_ex");
	struct ibv_srq_init_attr_ex xsa = sa;
	xsa.srq_type = IBV_SRQT_XRC;
	xsa.comp_mask |= IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ;
	errno = 0;
	CHECK(!ibv_create_srq_ex(ctx, &xsa) && errno == EINVAL, "XRC SRQ without a domain and CQ: NULL, EINVAL");
	struct ibv_qp_init_attr sqa = { .send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
					.cap = { .max_send_wr = 4, .max_send_sge = 1 } };
	struct ibv_qp *c = ibv_create_qp(pd, &sqa), *d = make_qp(cq, IBV_QPT_RC, NULL);
	REQUIRE(c && d && connect_qp(c, d->qp_num) == 0 && connect_qp(d, c->qp_num) == 0, "QP on an SRQ");
	for (int i = 0; i < 3; i++) {
		rwr.wr_id = 60 + i;
		CHECK(ibv_post_srq_recv(srq, &rwr, &bad_r) == 0, "ibv_post_srq_recv %d", i);
	}
	struct ibv_srq_attr lim = { .srq_limit = 3 };
	CHECK(ibv_modify_srq(srq, &lim, IBV_SRQ_LIMIT) == 0, "ibv_modify_srq arms the limit");
	struct ibv_srq_attr sq;
	CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 3, "ibv_query_srq");

	int fl = fcntl(ctx->async_fd, F_GETFL);
	fcntl(ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
	struct ibv_async_event ev;
	errno = 0;
	CHECK(ibv_get_async_event(ctx, &ev) == -1 && errno == EAGAIN, "no async event yet: -1, EAGAIN");
	fcntl(ctx->async_fd, F_SETFL, fl);

	struct ibv_sge ds = { .addr = (uintptr_t)&mem[0], .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr dw = { .wr_id = 70, .sg_list = &ds, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad_s;
	CHECK(ibv_post_send(d, &dw, &bad_s) == 0, "send to the SRQ QP");
	CHECK(poll_one(cq, &wc) && poll_one(cq, &wc), "send and SRQ receive complete");
	CHECK(ibv_get_async_event(ctx, &ev) == 0 && ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED &&
		      ev.element.srq == srq, "IBV_EVENT_SRQ_LIMIT_REACHED names the SRQ");
	ibv_ack_async_event(&ev);
	CHECK(srq->events_completed == 1, "ibv_ack_async_event counts in srq->events_completed");

	CHECK(ibv_destroy_qp(c) == 0 && ibv_destroy_qp(d) == 0 && ibv_destroy_srq(srq) == 0, "SRQ teardown");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0, "extended teardown");
	ibv_dereg_mr(mr);
	free(mem);
}

static void test_ud(void)
{
	char *mem = calloc(1, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 8192, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp *a = make_qp(cq, IBV_QPT_UD, NULL), *b = make_qp(cq, IBV_QPT_UD, NULL);
	REQUIRE(mr && cq && a && b && connect_qp(a, 0) == 0 && connect_qp(b, 0) == 0, "UD QPs to RTS");
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
				  .grh = { .dgid = gid, .sgid_index = gid_index, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	REQUIRE(ah && ah->pd == pd, "ibv_create_ah");
	struct ibv_ah_attr no_grh = { .port_num = 1, .dlid = 1 };
	errno = 0;
	CHECK(!ibv_create_ah(pd, &no_grh) && errno == EINVAL, "an AH without GRH on RoCE: NULL, EINVAL");
	struct ibv_sge rs = { .addr = (uintptr_t)mem, .length = 40 + 64, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	ibv_post_recv(b, &rwr, &bad_r);
	strcpy(mem + 4096, "datagram");
	struct ibv_sge ss = { .addr = (uintptr_t)mem + 4096, .length = 9, .lkey = mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED,
				   .wr.ud = { .ah = ah, .remote_qpn = b->qp_num, .remote_qkey = 0x11111111 } }, *bad_s;
	CHECK(ibv_post_send(a, &swr, &bad_s) == 0, "UD send");
	struct ibv_wc wc, rwc = { 0 };
	for (int i = 0; i < 2 && poll_one(cq, &wc); i++)
		if (wc.opcode == IBV_WC_RECV)
			rwc = wc;
	CHECK(rwc.status == IBV_WC_SUCCESS && rwc.byte_len == 40 + 9 && (rwc.wc_flags & IBV_WC_GRH) &&
		      rwc.src_qp == a->qp_num && !strcmp(mem + 40, "datagram"), "UD receive with GRH");
	struct ibv_ah *reply = ibv_create_ah_from_wc(pd, &rwc, (struct ibv_grh *)mem, 1);
	CHECK(reply != NULL, "ibv_create_ah_from_wc");
	struct ibv_ah_attr ra;
	CHECK(ibv_init_ah_from_wc(ctx, 1, &rwc, (struct ibv_grh *)mem, &ra) == 0 && ra.is_global &&
		      !memcmp(&ra.grh.dgid, &gid, 16), "ibv_init_ah_from_wc answers the sender");
	union ibv_gid mgid = { .raw = { 0xff, 0x0e, [15] = 1 } };
	CHECK(ibv_attach_mcast(b, &mgid, 0) == 0, "ibv_attach_mcast");
	CHECK(ibv_destroy_qp(b) == EBUSY, "destroying an attached QP: EBUSY");
	CHECK(ibv_detach_mcast(b, &mgid, 0) == 0 && ibv_detach_mcast(b, &mgid, 0) == EINVAL, "ibv_detach_mcast");
	ibv_destroy_ah(reply);
	CHECK(ibv_destroy_ah(ah) == 0, "ibv_destroy_ah");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	free(mem);
}

static struct ibv_qp *make_qp_on(struct ibv_pd *on, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr a = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2,
			 .max_recv_sge = 2, .max_inline_data = 64 },
	};
	return ibv_create_qp(on, &a);
}

/* Posts a receive of `rlen` bytes at `raddr` on b and a send of `slen` bytes at `saddr` from a;
 * returns the receive completion's byte count, or -1. */
static int send_recv(struct ibv_qp *a, struct ibv_qp *b, struct ibv_cq *cq, uint64_t saddr, uint32_t slen,
		     uint32_t slkey, uint64_t raddr, uint32_t rlen, uint32_t rlkey)
{
	struct ibv_sge rs = { .addr = raddr, .length = rlen, .lkey = rlkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	struct ibv_sge ss = { .addr = saddr, .length = slen, .lkey = slkey };
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED }, *bad_s;
	if (ibv_post_recv(b, &rwr, &bad_r) || ibv_post_send(a, &swr, &bad_s))
		return -1;
	struct ibv_wc wc;
	int len = -1;
	for (int i = 0; i < 2; i++) {
		if (!poll_one(cq, &wc) || wc.status != IBV_WC_SUCCESS)
			return -1;
		if (wc.opcode == IBV_WC_RECV)
			len = wc.byte_len;
	}
	return len;
}

/* ibv_alloc_null_mr(3): writes through the lkey are discarded, reads give zeros. */
static void test_null_mr(void)
{
	struct ibv_mr *null = ibv_alloc_null_mr(pd);
	REQUIRE(null && null->pd == pd && null->addr == NULL, "ibv_alloc_null_mr");
	char *mem = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp *a = make_qp_on(pd, cq), *b = make_qp_on(pd, cq);
	REQUIRE(mr && cq && a && b && connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0,
		"RC QPs for null MR traffic");
	strcpy(mem, "discard this");
	CHECK(send_recv(a, b, cq, (uintptr_t)mem, 13, mr->lkey, 0x1000, 64, null->lkey) == 13,
	      "a receive into the null MR completes with the byte count");
	memset(mem + 512, 0xff, 64);
	CHECK(send_recv(a, b, cq, 0x2000, 16, null->lkey, (uintptr_t)mem + 512, 64, mr->lkey) == 16 &&
		      !memcmp(mem + 512, (char[16]){ 0 }, 16) && (unsigned char)mem[512 + 16] == 0xff,
	      "a send gathering from the null MR sends zeros");
	/* A scatter list that skips a header through the null MR. */
	strcpy(mem + 1024, "headerpayload");
	memset(mem + 2048, 0, 64);
	struct ibv_sge rs[2] = { { .addr = 0, .length = 6, .lkey = null->lkey },
				 { .addr = (uintptr_t)mem + 2048, .length = 64, .lkey = mr->lkey } };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = rs, .num_sge = 2 }, *bad_r;
	struct ibv_sge ss = { .addr = (uintptr_t)mem + 1024, .length = 14, .lkey = mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 2, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED }, *bad_s;
	struct ibv_wc wc;
	int ok = ibv_post_recv(b, &rwr, &bad_r) == 0 && ibv_post_send(a, &swr, &bad_s) == 0;
	for (int i = 0; i < 2 && ok; i++)
		ok = poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS;
	CHECK(ok && !strcmp(mem + 2048, "payload"), "the null MR skips part of a scatter list");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0, "null MR QPs destroyed");
	CHECK(ibv_dereg_mr(null) == 0 && ibv_dereg_mr(mr) == 0, "ibv_dereg_mr frees the null MR");
	free(mem);
}

static void test_device_memory(void)
{
	struct ibv_device_attr_ex dx = { 0 };
	REQUIRE(ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.max_dm_size > 0, "max_dm_size %llu advertised",
		(unsigned long long)dx.max_dm_size);
	struct ibv_alloc_dm_attr da = { .length = 4096, .log_align_req = 3 };
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
	REQUIRE(dm && dm->context == ctx && (dm->comp_mask & IBV_DM_MASK_HANDLE), "ibv_alloc_dm");
	struct ibv_alloc_dm_attr bad = { .length = 0 };
	errno = 0;
	CHECK(!ibv_alloc_dm(ctx, &bad) && errno == EINVAL, "ibv_alloc_dm of 0 bytes: NULL, EINVAL");
	bad.length = dx.max_dm_size + 1;
	errno = 0;
	CHECK(!ibv_alloc_dm(ctx, &bad) && errno == EINVAL, "ibv_alloc_dm above max_dm_size: NULL, EINVAL");
	bad.length = 64;
	bad.comp_mask = 1;
	errno = 0;
	CHECK(!ibv_alloc_dm(ctx, &bad) && errno == EINVAL, "ibv_alloc_dm with unknown comp_mask: NULL, EINVAL");
	bad.comp_mask = 0;
	bad.log_align_req = 40;
	errno = 0;
	CHECK(!ibv_alloc_dm(ctx, &bad) && errno == EINVAL, "ibv_alloc_dm with a 2^40 alignment: NULL, EINVAL");
	struct ibv_alloc_dm_attr rest = { .length = dx.max_dm_size - 4096 + 1 };
	errno = 0;
	CHECK(!ibv_alloc_dm(ctx, &rest) && errno == ENOMEM, "the total is limited by max_dm_size: NULL, ENOMEM");
	rest.length = dx.max_dm_size - 4096;
	struct ibv_dm *dm2 = ibv_alloc_dm(ctx, &rest);
	CHECK(dm2 && ibv_free_dm(dm2) == 0, "the remaining device memory can be allocated and freed");

	char out[64] = "device memory", in[64] = { 0 };
	CHECK(ibv_memcpy_to_dm(dm, 100, out, 14) == 0, "ibv_memcpy_to_dm");
	CHECK(ibv_memcpy_from_dm(in, dm, 100, 14) == 0 && !strcmp(in, "device memory"), "ibv_memcpy_from_dm");
	CHECK(ibv_memcpy_to_dm(dm, 4090, out, 7) == EINVAL, "ibv_memcpy_to_dm past the end: EINVAL");
	CHECK(ibv_memcpy_from_dm(in, dm, 4096, 1) == EINVAL, "ibv_memcpy_from_dm past the end: EINVAL");

	errno = 0;
	CHECK(!ibv_reg_dm_mr(pd, dm, 0, 4096, IBV_ACCESS_LOCAL_WRITE) && errno == EINVAL,
	      "ibv_reg_dm_mr without IBV_ACCESS_ZERO_BASED: NULL, EINVAL");
	errno = 0;
	CHECK(!ibv_reg_dm_mr(pd, dm, 2048, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ZERO_BASED) && errno == EINVAL,
	      "ibv_reg_dm_mr past the end: NULL, EINVAL");
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		  IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_ZERO_BASED;
	struct ibv_mr *dmr = ibv_reg_dm_mr(pd, dm, 1024, 2048, acc);
	REQUIRE(dmr && dmr->length == 2048 && dmr->pd == pd, "ibv_reg_dm_mr");
	CHECK(ibv_free_dm(dm) == EBUSY, "ibv_free_dm while an MR uses it: EBUSY");

	char *mem = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				      IBV_ACCESS_REMOTE_READ);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp *a = make_qp_on(pd, cq), *b = make_qp_on(pd, cq);
	REQUIRE(mr && cq && a && b && connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0,
		"RC QPs for device memory traffic");
	/* Local: receive into the DM region at offset 16 (zero based: DM byte 1024 + 16). */
	strcpy(mem, "into the dm");
	CHECK(send_recv(a, b, cq, (uintptr_t)mem, 12, mr->lkey, 16, 64, dmr->lkey) == 12,
	      "a receive scatters into a DM region addressed by offset");
	memset(in, 0, sizeof(in));
	CHECK(ibv_memcpy_from_dm(in, dm, 1024 + 16, 12) == 0 && !strcmp(in, "into the dm"),
	      "the received bytes are in device memory");
	/* Gather from the DM. */
	CHECK(send_recv(b, a, cq, 16, 12, dmr->lkey, (uintptr_t)mem + 512, 64, mr->lkey) == 12 &&
		      !strcmp(mem + 512, "into the dm"), "a send gathers from a DM region");
	/* Remote: RDMA WRITE and READ to the DM region by rkey and offset. */
	strcpy(mem + 1024, "remote write");
	struct ibv_sge ws = { .addr = (uintptr_t)mem + 1024, .length = 13, .lkey = mr->lkey };
	struct ibv_send_wr wwr = { .wr_id = 3, .sg_list = &ws, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				   .send_flags = IBV_SEND_SIGNALED,
				   .wr.rdma = { .remote_addr = 256, .rkey = dmr->rkey } }, *bad_s;
	struct ibv_wc wc;
	CHECK(ibv_post_send(a, &wwr, &bad_s) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS,
	      "RDMA WRITE into a DM region");
	memset(in, 0, sizeof(in));
	CHECK(ibv_memcpy_from_dm(in, dm, 1024 + 256, 13) == 0 && !strcmp(in, "remote write"),
	      "the written bytes are in device memory");
	struct ibv_sge rds = { .addr = (uintptr_t)mem + 2048, .length = 13, .lkey = mr->lkey };
	struct ibv_send_wr rwr = { .wr_id = 4, .sg_list = &rds, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
				   .send_flags = IBV_SEND_SIGNALED,
				   .wr.rdma = { .remote_addr = 256, .rkey = dmr->rkey } };
	CHECK(ibv_post_send(b, &rwr, &bad_s) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      !strcmp(mem + 2048, "remote write"), "RDMA READ from a DM region");
	wwr.wr.rdma.remote_addr = 2048 - 4;
	CHECK(ibv_post_send(a, &wwr, &bad_s) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR,
	      "RDMA WRITE past the end of a DM region: remote access error");

	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	free(mem);
	CHECK(ibv_dereg_mr(dmr) == 0 && ibv_free_dm(dm) == 0, "ibv_free_dm once its MRs are gone");
}

/* A parent domain's allocator: records what it was asked for. */
struct alloc_log {
	int allocs, frees, defaults, bad_size;
	uint64_t types[16];
	void *live[16];
	size_t sizes[16];
};

/* Whether a buffer alloc handed out (and that is not yet freed) holds `len` bytes equal to `pat`. */
static int alloc_holds(const struct alloc_log *log, const void *pat, size_t len)
{
	for (int i = 0; i < 16; i++)
		for (size_t off = 0; log->live[i] && off + len <= log->sizes[i]; off++)
			if (!memcmp((const char *)log->live[i] + off, pat, len))
				return 1;
	return 0;
}

static void *pd_alloc(struct ibv_pd *on, void *pd_context, size_t size, size_t alignment, uint64_t type)
{
	struct alloc_log *log = pd_context;
	if (size == 0 || size > (64 << 20) || alignment == 0 || (alignment & (alignment - 1)))
		log->bad_size++;
	if (log->allocs < 16)
		log->types[log->allocs] = type;
	/* Every third request asks for the library's default allocator. */
	if (++log->allocs % 3 == 0) {
		log->defaults++;
		return IBV_ALLOCATOR_USE_DEFAULT;
	}
	void *p = NULL;
	if (posix_memalign(&p, alignment, size))
		return NULL;
	memset(p, 0, size);
	for (int i = 0; i < 16; i++)
		if (!log->live[i]) {
			log->live[i] = p;
			log->sizes[i] = size;
			break;
		}
	return p;
}

static void pd_free(struct ibv_pd *on, void *pd_context, void *ptr, uint64_t type)
{
	struct alloc_log *log = pd_context;
	for (int i = 0; i < 16; i++)
		if (log->live[i] == ptr) {
			log->live[i] = NULL;
			log->frees++;
			free(ptr);
			return;
		}
	log->bad_size += 1000; /* freeing something we did not hand out */
}

static void test_parent_domain(void)
{
	struct ibv_td_init_attr ta = { .comp_mask = 1 };
	errno = 0;
	CHECK(!ibv_alloc_td(ctx, &ta) && errno == EINVAL, "ibv_alloc_td with unknown comp_mask: NULL, EINVAL");
	ta.comp_mask = 0;
	struct ibv_td *td = ibv_alloc_td(ctx, &ta);
	REQUIRE(td && td->context == ctx, "ibv_alloc_td");
	struct ibv_pd *inner = ibv_alloc_pd(ctx);
	struct alloc_log log = { 0 };
	struct ibv_parent_domain_init_attr pa = { .pd = NULL, .td = td };
	errno = 0;
	CHECK(!ibv_alloc_parent_domain(ctx, &pa) && errno == EINVAL, "ibv_alloc_parent_domain without a PD: NULL, EINVAL");
	pa.pd = inner;
	pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS;
	errno = 0;
	CHECK(!ibv_alloc_parent_domain(ctx, &pa) && errno == EINVAL, "ALLOCATORS with NULL callbacks: NULL, EINVAL");
	pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
	pa.alloc = pd_alloc;
	pa.free = pd_free;
	pa.pd_context = &log;
	struct ibv_pd *par = ibv_alloc_parent_domain(ctx, &pa);
	REQUIRE(par && par != inner && par->handle == inner->handle && par->context == ctx,
		"ibv_alloc_parent_domain: a PD with the inner PD's handle");
	CHECK(ibv_dealloc_pd(inner) == EBUSY, "the inner PD is busy while the parent domain exists");
	CHECK(ibv_dealloc_td(td) == EBUSY, "the thread domain is busy while the parent domain uses it");

	struct ibv_cq_init_attr_ex ca = { .cqe = 16, .comp_mask = IBV_CQ_INIT_ATTR_MASK_PD, .parent_domain = inner };
	errno = 0;
	CHECK(!ibv_create_cq_ex(ctx, &ca) && errno == EINVAL, "IBV_CQ_INIT_ATTR_MASK_PD with a plain PD: NULL, EINVAL");
	ca.parent_domain = par;
	struct ibv_context *other = ibv_open_device(ctx->device);
	errno = 0;
	CHECK(other && !ibv_create_cq_ex(other, &ca) && errno == EINVAL && log.allocs == 0,
	      "a CQ in another context through this parent domain: NULL, EINVAL");
	struct ibv_parent_domain_init_attr foreign = { .pd = inner };
	errno = 0;
	CHECK(other && !ibv_alloc_parent_domain(other, &foreign) && errno == EINVAL,
	      "a parent domain over another context's PD: NULL, EINVAL");
	ibv_close_device(other);
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &ca);
	REQUIRE(cqx, "ibv_create_cq_ex on the parent domain");
	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
	CHECK(log.allocs == 1 && log.types[0] == 3 && log.bad_size == 0,
	      "the CQ's poll ring comes from alloc (type %llu)", (unsigned long long)log.types[0]);
	struct ibv_qp *a = make_qp_on(par, cq), *b = make_qp_on(par, cq);
	REQUIRE(a && b && a->pd == par, "ibv_create_qp on the parent domain");
	CHECK(log.allocs == 5 && log.types[1] == 1 && log.types[2] == 2 && log.types[3] == 1 && log.types[4] == 2 &&
		      log.defaults == 1 && log.bad_size == 0,
	      "each QP's send and receive queues come from alloc (%d calls, one answered USE_DEFAULT)", log.allocs);
	CHECK(ibv_dealloc_pd(par) == EBUSY, "the parent domain is busy while its CQ and QPs exist");
	char *mem = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(par, mem, 4096, IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr && mr->pd == par, "ibv_reg_mr on the parent domain");
	REQUIRE(connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0, "parent domain QPs to RTS");
	strcpy(mem, "parent domain");
	int ok = 1;
	for (int i = 0; i < 40 && ok; i++)
		ok = send_recv(a, b, cq, (uintptr_t)mem, 14, mr->lkey, (uintptr_t)mem + 1024, 64, mr->lkey) == 14;
	CHECK(ok && !strcmp(mem + 1024, "parent domain"), "traffic on parent-domain QPs and CQ (40 round trips)");
	/* a's send queue and b's receive queue came from alloc: the WQEs were written there. */
	struct ibv_sge sent = { .addr = (uintptr_t)mem, .length = 14, .lkey = mr->lkey };
	struct ibv_sge received = { .addr = (uintptr_t)mem + 1024, .length = 64, .lkey = mr->lkey };
	CHECK(alloc_holds(&log, &sent, sizeof sent) && alloc_holds(&log, &received, sizeof received),
	      "posted gather and scatter lists pass through the allocated queue buffers");
	{
		static const char marker[] = "inline bytes staged in the send queue";
		struct ibv_sge rs = { .addr = (uintptr_t)mem + 2048, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = 3, .sg_list = &rs, .num_sge = 1 }, *bad_r;
		struct ibv_sge ss = { .addr = (uintptr_t)marker, .length = sizeof marker };
		struct ibv_send_wr swr = { .wr_id = 4, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
					   .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE }, *bad_s;
		struct ibv_wc wc;
		int got = 0;
		if (!ibv_post_recv(b, &rwr, &bad_r) && !ibv_post_send(a, &swr, &bad_s))
			for (int i = 0; i < 2 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS; i++)
				got++;
		CHECK(got == 2 && !strcmp(mem + 2048, marker) && alloc_holds(&log, marker, sizeof marker),
		      "inline data passes through the allocated send queue");
	}
	{
		/* a's receive queue is the library's (USE_DEFAULT), so this wr_id reaches an allocated
		 * buffer only through the CQ's poll ring, which the extended pollers use too. */
		uint64_t id = 0x5eed0123456789abULL;
		struct ibv_sge rs = { .addr = (uintptr_t)mem + 3072, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = id, .sg_list = &rs, .num_sge = 1 }, *bad_r;
		struct ibv_sge ss = { .addr = (uintptr_t)mem, .length = 14, .lkey = mr->lkey };
		struct ibv_send_wr swr = { .wr_id = 5, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
					   .send_flags = IBV_SEND_SIGNALED }, *bad_s;
		int before = alloc_holds(&log, &id, sizeof id), seen = 0, staged = 0;
		if (!ibv_post_recv(a, &rwr, &bad_r) && !ibv_post_send(b, &swr, &bad_s)) {
			struct ibv_poll_cq_attr pa = { 0 };
			for (int spins = 0; seen < 2 && spins < 10000000; spins++) {
				if (ibv_start_poll(cqx, &pa))
					continue;
				do {
					seen += cqx->status == IBV_WC_SUCCESS;
					/* The ring holds the completion being read. */
					staged |= cqx->wr_id == id && alloc_holds(&log, &id, sizeof id);
				} while (seen < 2 && ibv_next_poll(cqx) == 0);
				ibv_end_poll(cqx);
			}
		}
		CHECK(!before && seen == 2 && staged,
		      "ibv_start_poll stages completions in the allocated poll ring");
	}
	{
		/* Two SRQs: the sixth allocation is answered USE_DEFAULT, the seventh from alloc. */
		struct ibv_srq_init_attr sa = { .attr = { .max_wr = 8, .max_sge = 1 } };
		struct ibv_srq *s1 = ibv_create_srq(par, &sa), *s2 = ibv_create_srq(par, &sa);
		REQUIRE(s1 && s2 && s2->pd == par, "ibv_create_srq on the parent domain");
		CHECK(log.allocs == 7 && log.types[5] == 4 && log.types[6] == 4,
		      "each SRQ's receive queue comes from alloc (type %llu)", (unsigned long long)log.types[6]);
		struct ibv_sge rs = { .addr = (uintptr_t)mem + 3333, .length = 77, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = 9, .sg_list = &rs, .num_sge = 1 }, *bad_r;
		CHECK(!alloc_holds(&log, &rs, sizeof rs) && ibv_post_srq_recv(s2, &rwr, &bad_r) == 0 &&
			      alloc_holds(&log, &rs, sizeof rs),
		      "SRQ receives pass through the allocated receive queue");
		CHECK(ibv_destroy_srq(s1) == 0 && ibv_destroy_srq(s2) == 0, "parent domain SRQs destroyed");
	}
	{
		/* The eighth allocation: a receive WQ's buffer. */
		struct ibv_wq_init_attr wa = { .wq_type = IBV_WQT_RQ, .max_wr = 8, .max_sge = 1, .pd = par, .cq = cq };
		struct ibv_wq *wq = ibv_create_wq(ctx, &wa);
		REQUIRE(wq, "ibv_create_wq on the parent domain");
		CHECK(log.allocs == 8 && log.types[7] == 5, "the WQ's buffer comes from alloc (type %llu)",
		      (unsigned long long)log.types[7]);
		struct ibv_wq_attr rdy = { .attr_mask = IBV_WQ_ATTR_STATE, .wq_state = IBV_WQS_RDY };
		struct ibv_sge rs = { .addr = (uintptr_t)mem + 3500, .length = 55, .lkey = mr->lkey };
		struct ibv_recv_wr rwr = { .wr_id = 10, .sg_list = &rs, .num_sge = 1 }, *bad_r;
		CHECK(ibv_modify_wq(wq, &rdy) == 0 && !alloc_holds(&log, &rs, sizeof rs) &&
			      ibv_post_wq_recv(wq, &rwr, &bad_r) == 0 && alloc_holds(&log, &rs, sizeof rs),
		      "WQ receives pass through the allocated buffer");
		CHECK(ibv_destroy_wq(wq) == 0, "parent domain WQ destroyed");
	}
	struct ibv_wc wcs[4];
	CHECK(ibv_poll_cq(cq, 4, wcs) == 0, "the CQ is empty afterwards");
	ibv_dereg_mr(mr);
	free(mem);
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_cq(cq) == 0, "parent domain teardown");
	CHECK(log.frees == log.allocs - log.defaults && log.bad_size == 0,
	      "free returns every buffer alloc gave (%d of %d)", log.frees, log.allocs);
	CHECK(ibv_dealloc_pd(par) == 0, "ibv_dealloc_pd frees the parent domain");
	CHECK(ibv_dealloc_td(td) == 0 && ibv_dealloc_pd(inner) == 0, "then the TD and the inner PD");

	/* Without allocators the library allocates; the parent domain still works as a PD. */
	inner = ibv_alloc_pd(ctx);
	struct ibv_parent_domain_init_attr plain = { .pd = inner };
	par = ibv_alloc_parent_domain(ctx, &plain);
	struct ibv_cq *cq2 = ibv_create_cq(ctx, 8, NULL, NULL, 0);
	struct ibv_qp *q = par && cq2 ? make_qp_on(par, cq2) : NULL;
	CHECK(q != NULL, "a QP on a parent domain without allocators");
	CHECK(ibv_destroy_qp(q) == 0 && ibv_destroy_cq(cq2) == 0 && ibv_dealloc_pd(par) == 0 && ibv_dealloc_pd(inner) == 0,
	      "teardown without allocators");
}

static void test_import(void)
{
	CHECK(ctx->cmd_fd >= 0 && fcntl(ctx->cmd_fd, F_GETFD) >= 0, "cmd_fd is a real descriptor");
	errno = 0;
	CHECK(!ibv_import_device(ctx->async_fd) && errno == EINVAL, "ibv_import_device on another fd: NULL, EINVAL");
	CHECK(fcntl(ctx->async_fd, F_GETFD) >= 0, "a refused fd stays open");
	errno = 0;
	CHECK(!ibv_import_device(-1) && errno == EINVAL, "ibv_import_device(-1): NULL, EINVAL");
	int fd = dup(ctx->cmd_fd);
	struct ibv_context *ctx2 = ibv_import_device(fd);
	REQUIRE(ctx2 && ctx2 != ctx && ctx2->cmd_fd == fd && ctx2->device == ctx->device,
		"ibv_import_device(dup(cmd_fd)) gives a second context");
	errno = 0;
	CHECK(!ibv_import_pd(ctx2, 0xdeadbeef) && errno == EINVAL, "ibv_import_pd of a bad handle: NULL, EINVAL");
	struct ibv_pd *pd2 = ibv_import_pd(ctx2, pd->handle);
	REQUIRE(pd2 && pd2 != pd && pd2->handle == pd->handle && pd2->context == ctx2, "ibv_import_pd");

	char *mem = calloc(1, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				      IBV_ACCESS_REMOTE_READ);
	REQUIRE(mr, "an MR to share");
	errno = 0;
	CHECK(!ibv_import_mr(pd2, pd->handle) && errno == EINVAL, "ibv_import_mr of a PD's handle: NULL, EINVAL");
	struct ibv_mr *mr2 = ibv_import_mr(pd2, mr->handle);
	REQUIRE(mr2 && mr2->addr == NULL && mr2->length == 8192 && mr2->lkey == mr->lkey && mr2->rkey == mr->rkey &&
			mr2->pd == pd2 && mr2->context == ctx2, "ibv_import_mr: same keys and length, addr NULL");

	/* Traffic between a QP of ctx and a QP of ctx2 built on the imported PD and MR. */
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0), *cq2 = ibv_create_cq(ctx2, 16, NULL, NULL, 0);
	struct ibv_qp *a = make_qp_on(pd, cq), *b = make_qp_on(pd2, cq2);
	REQUIRE(cq && cq2 && a && b && connect_qp(a, b->qp_num) == 0 && connect_qp(b, a->qp_num) == 0,
		"a QP on the imported PD");
	strcpy(mem + 4096, "through an imported MR");
	struct ibv_sge ss = { .addr = (uintptr_t)mem + 4096, .length = 23, .lkey = mr2->lkey };
	struct ibv_send_wr wr = { .wr_id = 9, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED,
				  .wr.rdma = { .remote_addr = (uintptr_t)mem + 100, .rkey = mr->rkey } }, *bad;
	struct ibv_wc wc;
	CHECK(ibv_post_send(b, &wr, &bad) == 0 && poll_one(cq2, &wc) && wc.status == IBV_WC_SUCCESS &&
		      !strcmp(mem + 100, "through an imported MR"), "RDMA WRITE with the imported MR's lkey");
	struct ibv_qp_attr sqd = { .qp_state = IBV_QPS_SQD, .en_sqd_async_notify = 1 };
	struct pollfd pfd = { .fd = ctx2->async_fd, .events = POLLIN };
	struct ibv_async_event ev;
	CHECK(ibv_modify_qp(b, &sqd, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY) == 0 && poll(&pfd, 1, 10000) == 1 &&
		      ibv_get_async_event(ctx2, &ev) == 0 && ev.event_type == IBV_EVENT_SQ_DRAINED && ev.element.qp == b,
	      "async events of a QP on an imported PD reach the importing context");
	ibv_ack_async_event(&ev);

	struct ibv_alloc_dm_attr da = { .length = 256 };
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
	struct ibv_dm *dm2 = dm ? ibv_import_dm(ctx2, dm->handle) : NULL;
	char in[8] = { 0 };
	CHECK(dm2 && dm2->handle == dm->handle && ibv_memcpy_to_dm(dm, 0, "shared", 7) == 0 &&
		      ibv_memcpy_from_dm(in, dm2, 0, 7) == 0 && !strcmp(in, "shared"), "ibv_import_dm sees the same memory");
	uint32_t dm_handle = dm ? dm->handle : 0;
	ibv_unimport_dm(dm2);
	CHECK(ibv_free_dm(dm) == 0, "ibv_free_dm after ibv_unimport_dm");
	errno = 0;
	CHECK(!ibv_import_dm(ctx2, dm_handle) && errno == EINVAL, "ibv_import_dm of a freed DM: NULL, EINVAL");

	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);
	ibv_destroy_cq(cq2);
	ibv_unimport_mr(mr2);
	CHECK(ibv_import_mr(pd2, mr->handle) != NULL, "after ibv_unimport_mr the MR lives on");
	struct ibv_mr *again = ibv_import_mr(pd2, mr->handle);
	uint32_t handle = mr->handle;
	CHECK(ibv_dereg_mr(again) == 0, "ibv_dereg_mr through an imported MR");
	errno = 0;
	CHECK(!ibv_import_mr(pd2, handle) && errno == EINVAL, "dereg destroyed it for every sharer: EINVAL");
	free(mem);

	struct ibv_pd *extra = ibv_alloc_pd(ctx2);
	REQUIRE(extra, "a PD allocated through the imported context");
	struct ibv_pd *back = ibv_import_pd(ctx, extra->handle);
	CHECK(back && back->handle == extra->handle, "is importable from the first context");
	ibv_unimport_pd(pd2);
	CHECK(ibv_dealloc_pd(back) == 0, "ibv_dealloc_pd through an imported PD");
	errno = 0;
	CHECK(!ibv_import_pd(ctx, extra->handle) && errno == EINVAL, "dealloc destroyed it for every sharer: EINVAL");
	ibv_unimport_pd(extra);
	CHECK(ibv_close_device(ctx2) == 0 && fcntl(fd, F_GETFD) == -1 && errno == EBADF,
	      "ibv_close_device of the imported context closes its fd");
	CHECK(fcntl(ctx->cmd_fd, F_GETFD) >= 0, "the first context's cmd_fd stays open");
}

/* Every failing verb leaves its error in errno, the value it returns when it returns one. */
static void test_errno(void)
{
	struct ibv_port_attr pa;
	CHECK_ERR(ibv_query_port(ctx, 2, &pa), EINVAL, "ibv_query_port on port 2");
	struct ibv_gid_entry ge;
	CHECK_ERR(ibv_query_gid_ex(ctx, 1, gid_index, &ge, 1), EINVAL, "ibv_query_gid_ex with flags");
	errno = ERRNO_SENTINEL;
	CHECK(ibv_query_gid_table(ctx, &ge, 1, 1) == -EINVAL && errno == EINVAL,
	      "ibv_query_gid_table with flags: -EINVAL and errno EINVAL");

	char *mem = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, ch, 0);
	REQUIRE(mr && ch && cq, "errno checks: MR, channel and CQ");
	CHECK_ERR(ibv_resize_cq(cq, 0), EINVAL, "ibv_resize_cq to 0 entries");
	CHECK_ERR(ibv_resize_cq(cq, 1 << 30), EINVAL, "ibv_resize_cq beyond max_cqe");
	CHECK_ERR(ibv_destroy_comp_channel(ch), EBUSY, "ibv_destroy_comp_channel while a CQ uses it");
	struct ibv_wc wc;
	errno = ERRNO_SENTINEL;
	CHECK(ibv_poll_cq(cq, -1, &wc) == -EINVAL && errno == EINVAL,
	      "ibv_poll_cq of -1 entries: -EINVAL and errno EINVAL");

	struct ibv_srq_init_attr si = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	struct ibv_qp *qp = make_qp(cq, IBV_QPT_RC, NULL);
	struct ibv_qp_init_attr sqa = { .send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
					.cap = { .max_send_wr = 4, .max_send_sge = 1 } };
	struct ibv_qp *sqp = ibv_create_qp(pd, &sqa);
	REQUIRE(srq && qp && sqp, "errno checks: SRQ and QPs");
	CHECK_ERR(ibv_destroy_cq(cq), EBUSY, "ibv_destroy_cq while a QP uses it");
	CHECK_ERR(ibv_destroy_srq(srq), EBUSY, "ibv_destroy_srq while a QP uses it");
	CHECK_ERR(ibv_dealloc_pd(pd), EBUSY, "ibv_dealloc_pd while used");
	struct ibv_srq_attr sa = { .srq_limit = 100 };
	CHECK_ERR(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT), EINVAL, "ibv_modify_srq with a limit above max_wr");
	uint32_t srqn;
	CHECK(ibv_get_srq_num(srq, &srqn) == 0 && srqn <= 0xFFFFFF, "ibv_get_srq_num of a basic SRQ");

	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_RTS };
	CHECK_ERR(ibv_modify_qp(qp, &qa, IBV_QP_STATE), EINVAL, "ibv_modify_qp RESET to RTS");
	qa.qp_state = IBV_QPS_INIT;
	CHECK_ERR(ibv_modify_qp(qp, &qa, IBV_QP_STATE), EINVAL,
		  "ibv_modify_qp RESET to INIT without the required attributes");
	qa.qp_state = 99;
	CHECK_ERR(ibv_modify_qp(qp, &qa, IBV_QP_STATE), EINVAL, "ibv_modify_qp to state 99");
	qa.qp_state = IBV_QPS_INIT;
	CHECK_ERR(ibv_modify_qp(qp, &qa, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS |
						 IBV_QP_QKEY),
		  EINVAL, "ibv_modify_qp RESET to INIT with an attribute RC does not take (QKEY)");
	CHECK(qp->state == IBV_QPS_RESET, "a failed ibv_modify_qp leaves the QP in RESET");
	struct ibv_qp_init_attr qi;
	CHECK_ERR(ibv_query_qp(qp, &qa, IBV_QP_STATE, NULL), EINVAL, "ibv_query_qp without init_attr");

	struct ibv_sge sge = { .addr = (uintptr_t)mem, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND },
			   *bad_s = NULL;
	CHECK_ERR(ibv_post_send(qp, &swr, &bad_s), EINVAL, "ibv_post_send on a RESET QP");
	CHECK(bad_s == &swr, "... names the work request in bad_wr");
	struct ibv_recv_wr rwr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *bad_r = NULL;
	CHECK_ERR(ibv_post_recv(qp, &rwr, &bad_r), EINVAL, "ibv_post_recv on a RESET QP");
	CHECK(bad_r == &rwr, "... names the work request in bad_wr");
	bad_r = NULL;
	CHECK_ERR(ibv_post_recv(sqp, &rwr, &bad_r), EINVAL, "ibv_post_recv on a QP with an SRQ");
	rwr.num_sge = 2;
	bad_r = NULL;
	CHECK_ERR(ibv_post_srq_recv(srq, &rwr, &bad_r), EINVAL, "ibv_post_srq_recv with too many SGEs");
	CHECK(bad_r == &rwr, "... names the work request in bad_wr");
	rwr.num_sge = 1;
	for (int i = 0; i < 4; i++)
		ibv_post_srq_recv(srq, &rwr, &bad_r);
	CHECK_ERR(ibv_post_srq_recv(srq, &rwr, &bad_r), ENOMEM, "ibv_post_srq_recv on a full SRQ");

	CHECK(ibv_query_qp(qp, &qa, IBV_QP_STATE, &qi) == 0 && qa.qp_state == IBV_QPS_RESET, "ibv_query_qp");

	union ibv_gid ucast = gid;
	CHECK_ERR(ibv_attach_mcast(qp, &ucast, 0), EINVAL, "ibv_attach_mcast of a unicast GID");
	union ibv_gid mgid = { .raw = { 0xff, 0x0e, [15] = 2 } };
	CHECK_ERR(ibv_detach_mcast(qp, &mgid, 0), EINVAL, "ibv_detach_mcast of a group not attached");

	struct ibv_ah_attr bad_ah = { .is_global = 1, .port_num = 1,
				      .grh = { .dgid = gid, .sgid_index = 200, .hop_limit = 1 } };
	CHECK_NULL_ERR(ibv_create_ah(pd, &bad_ah), EINVAL, "ibv_create_ah with an SGID index out of range");
	bad_ah.grh.sgid_index = gid_index;
	bad_ah.port_num = 2;
	CHECK_NULL_ERR(ibv_create_ah(pd, &bad_ah), EINVAL, "ibv_create_ah on port 2");
	uint8_t mac[6];
	uint16_t vid;
	CHECK_ERR(ibv_resolve_eth_l2_from_gid(ctx, &bad_ah, mac, &vid), EOPNOTSUPP, "ibv_resolve_eth_l2_from_gid");

	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(qp);
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_xrc_srqn(qx, 5);
	CHECK_ERR(ibv_wr_complete(qx), EINVAL, "ibv_wr_complete after ibv_wr_set_xrc_srqn on a non-XRC QP");
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)mem, 8);
	CHECK_ERR(ibv_wr_complete(qx), EINVAL, "ibv_wr_complete on a RESET QP");

	CHECK(ibv_destroy_qp(sqp) == 0 && ibv_destroy_qp(qp) == 0 && ibv_destroy_srq(srq) == 0 &&
		      ibv_destroy_cq(cq) == 0 && ibv_destroy_comp_channel(ch) == 0 && ibv_dereg_mr(mr) == 0,
	      "errno checks: teardown");
	free(mem);
}

/* A flow label wider than 20 bits is kept as its low 20 bits (UCX passes ~0 on RoCE). */
static void test_flow_label(void)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp *qp = make_qp(cq, IBV_QPT_RC, NULL);
	REQUIRE(cq && qp, "flow label checks: CQ and QP");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0,
		"flow label checks: QP to INIT");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = qp->qp_num;
	a.max_dest_rd_atomic = 1;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.grh.flow_label = 0xFFFFFFFF;
	a.ah_attr.port_num = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
	      "ibv_modify_qp accepts flow_label 0xFFFFFFFF");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	memset(&qa, 0, sizeof(qa));
	int qr = ibv_query_qp(qp, &qa, IBV_QP_AV, &qi);
	CHECK(qr == 0 && qa.ah_attr.grh.flow_label == 0xFFFFF, "ibv_query_qp gives it back as 0xFFFFF (got %#x)",
	      qa.ah_attr.grh.flow_label);
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
				  .grh = { .dgid = gid, .sgid_index = gid_index, .hop_limit = 1,
					   .flow_label = 0xFFFFFFFF } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	CHECK(ah != NULL, "ibv_create_ah accepts flow_label 0xFFFFFFFF");
	CHECK((!ah || ibv_destroy_ah(ah) == 0) && ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0,
	      "flow label checks: teardown");
}

/* XRC: RTR and RTS with exactly the attributes the kernel's state table requires per half. */
static int xrc_connect(struct ibv_qp *qp, uint32_t remote_qpn)
{
	int tgt = qp->qp_type == IBV_QPT_XRC_RECV;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		return -1;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = remote_qpn;
	a.max_dest_rd_atomic = 4;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
	if (ibv_modify_qp(qp, &a, mask | (tgt ? IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER : 0)))
		return -1;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 4;
	mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT;
	return ibv_modify_qp(qp, &a, mask | (tgt ? 0 : IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC));
}

/* ibv_open_xrcd(3), ibv_create_srq_ex(3), ibv_get_srq_num(3), ibv_create_qp_ex(3) with XRC types,
 * ibv_open_qp(3), remote_srqn and ibv_wr_set_xrc_srqn, and the teardown rules. */
static void test_xrc(void)
{
	struct ibv_device_attr da;
	CHECK(ibv_query_device(ctx, &da) == 0 && (da.device_cap_flags & IBV_DEVICE_XRC) && da.max_srq > 0,
	      "IBV_DEVICE_XRC and max_srq are reported");

	/* mkstemp(3) replaces the trailing six characters with a unique name. */
	char path[] = "/tmp/softverbs-xrcd-XXXXXX";
	int fd = mkstemp(path);
	REQUIRE(fd >= 0, "XRC checks: a file for the domain");
	struct ibv_xrcd_init_attr xa = { .comp_mask = IBV_XRCD_INIT_ATTR_FD, .fd = fd, .oflags = O_CREAT };
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EINVAL, "ibv_open_xrcd without OFLAGS in comp_mask");
	xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS | IBV_XRCD_INIT_ATTR_RESERVED;
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EOPNOTSUPP, "ibv_open_xrcd with a reserved comp_mask bit");
	xa.comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
	xa.oflags = 0;
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EAGAIN, "ibv_open_xrcd of a new inode without O_CREAT");
	xa.fd = -2;
	xa.oflags = O_CREAT;
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EBADF, "ibv_open_xrcd with a bad fd");
	xa.fd = fd;
	struct ibv_xrcd *x = ibv_open_xrcd(ctx, &xa);
	REQUIRE(x && x->context == ctx, "ibv_open_xrcd with O_CREAT");
	xa.oflags = O_CREAT | O_EXCL;
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EINVAL, "ibv_open_xrcd of an existing domain with O_EXCL");
	xa.oflags = 0;
	struct ibv_xrcd *x2 = ibv_open_xrcd(ctx, &xa);
	CHECK(x2 != NULL, "ibv_open_xrcd of an existing domain without O_CREAT");
	xa.fd = -1;
	struct ibv_xrcd *anon = ibv_open_xrcd(ctx, &xa);
	CHECK(anon != NULL, "ibv_open_xrcd with fd -1 makes an anonymous domain");

	struct ibv_cq *cq = ibv_create_cq(ctx, 32, NULL, NULL, 0), *rcq = ibv_create_cq(ctx, 32, NULL, NULL, 0);
	REQUIRE(cq && rcq, "XRC checks: CQs");
	struct ibv_srq_init_attr_ex sa = { .attr = { .max_wr = 8, .max_sge = 1 },
					   .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD |
							IBV_SRQ_INIT_ATTR_PD,
					   .srq_type = IBV_SRQT_XRC, .pd = pd, .xrcd = x, .cq = rcq };
	CHECK_NULL_ERR(ibv_create_srq_ex(ctx, &sa), EINVAL, "an XRC SRQ without IBV_SRQ_INIT_ATTR_CQ");
	sa.comp_mask |= IBV_SRQ_INIT_ATTR_CQ;
	struct ibv_srq *srq = ibv_create_srq_ex(ctx, &sa);
	REQUIRE(srq && sa.attr.max_wr >= 8, "ibv_create_srq_ex with IBV_SRQT_XRC");
	uint32_t srqn = 0, basic_n = 0;
	CHECK(ibv_get_srq_num(srq, &srqn) == 0 && srqn != 0 && srqn <= 0xFFFFFF, "ibv_get_srq_num: a 24-bit number");
	struct ibv_srq_init_attr bi = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *basic = ibv_create_srq(pd, &bi);
	CHECK(basic && ibv_get_srq_num(basic, &basic_n) == 0 && basic_n != srqn,
	      "every SRQ has its own number, as on ConnectX");
	CHECK(ibv_close_xrcd(x) == EBUSY && errno == EBUSY, "ibv_close_xrcd while an SRQ uses it: EBUSY");

	/* The initiator through ibv_create_qp_ex with exactly IBV_QP_INIT_ATTR_PD, which the inline
	 * wrapper turns into ibv_create_qp@1.1. */
	struct ibv_qp_init_attr_ex ia = { .qp_type = IBV_QPT_XRC_SEND, .send_cq = cq,
					  .cap = { .max_send_wr = 8, .max_send_sge = 1, .max_recv_wr = 8,
						   .max_recv_sge = 1 },
					  .comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pd };
	struct ibv_qp *ini = ibv_create_qp_ex(ctx, &ia);
	REQUIRE(ini && ini->qp_type == IBV_QPT_XRC_SEND, "ibv_create_qp_ex of an XRC_SEND QP");
	CHECK(ia.cap.max_recv_wr == 0 && ia.cap.max_recv_sge == 0 && ia.cap.max_send_wr >= 8,
	      "XRC_SEND: receive capabilities forced to 0");
	struct ibv_qp_init_attr_ex ta = { .qp_type = IBV_QPT_XRC_RECV, .comp_mask = IBV_QP_INIT_ATTR_XRCD };
	CHECK_NULL_ERR(ibv_create_qp_ex(ctx, &ta), EINVAL, "XRC_RECV without an XRC domain");
	ta.xrcd = x;
	struct ibv_qp *tgt = ibv_create_qp_ex(ctx, &ta);
	REQUIRE(tgt && tgt->qp_type == IBV_QPT_XRC_RECV && !tgt->pd && !tgt->send_cq && !tgt->recv_cq,
		"ibv_create_qp_ex of an XRC_RECV QP: no PD or CQs");

	struct ibv_qp_open_attr oa = { .comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD,
				       .qp_num = tgt->qp_num, .xrcd = x2, .qp_type = IBV_QPT_XRC_RECV };
	CHECK_NULL_ERR(ibv_open_qp(ctx, &oa), EINVAL, "ibv_open_qp without IBV_QP_OPEN_ATTR_TYPE");
	oa.comp_mask |= IBV_QP_OPEN_ATTR_TYPE | IBV_QP_OPEN_ATTR_CONTEXT;
	oa.qp_context = (void *)0x77;
	oa.xrcd = anon;
	CHECK_NULL_ERR(ibv_open_qp(ctx, &oa), EINVAL, "ibv_open_qp through another domain");
	oa.xrcd = x2;
	oa.qp_type = IBV_QPT_RC;
	CHECK_NULL_ERR(ibv_open_qp(ctx, &oa), EINVAL, "ibv_open_qp of type RC");
	oa.qp_type = IBV_QPT_XRC_RECV;
	struct ibv_qp *opened = ibv_open_qp(ctx, &oa);
	CHECK(opened && opened->qp_num == tgt->qp_num && opened->state == IBV_QPS_UNKNOWN &&
		      opened->qp_context == (void *)0x77 && !opened->pd,
	      "ibv_open_qp: the same QP number, state UNKNOWN, no PD");
	CHECK(ibv_close_xrcd(x2) == EBUSY, "ibv_close_xrcd while an opened QP uses it: EBUSY");

	REQUIRE(xrc_connect(ini, tgt->qp_num) == 0 && xrc_connect(tgt, ini->qp_num) == 0, "XRC QPs to RTS");
	char *mem = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	REQUIRE(mem && mr, "XRC checks: memory");
	struct ibv_sge rs = { .addr = (uintptr_t)mem + 2048, .length = 2048, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 7, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	CHECK(ibv_post_srq_recv(srq, &rw, &bad_r) == 0, "ibv_post_srq_recv on the XRC SRQ");
	rw.wr_id = 8;
	CHECK(ibv_post_srq_recv(srq, &rw, &bad_r) == 0, "ibv_post_srq_recv again");
	CHECK(ibv_post_recv(ini, &rw, &bad_r) == EINVAL, "ibv_post_recv on an XRC QP: EINVAL");
	strcpy(mem, "xrc hello");
	struct ibv_sge ss = { .addr = (uintptr_t)mem, .length = 10, .lkey = mr->lkey };
	struct ibv_send_wr sw = { .wr_id = 1, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad_s;
	sw.qp_type.xrc.remote_srqn = srqn;
	struct ibv_wc wc;
	CHECK(ibv_post_send(ini, &sw, &bad_s) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS &&
		      wc.wr_id == 1,
	      "SEND with qp_type.xrc.remote_srqn completes");
	CHECK(poll_one(rcq, &wc) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 7 && wc.qp_num == tgt->qp_num &&
		      wc.byte_len == 10 && !strcmp(mem + 2048, "xrc hello"),
	      "the receive completes on the SRQ's CQ with the XRC_RECV QP number");
	CHECK(ibv_post_send(tgt, &sw, &bad_s) == EINVAL, "ibv_post_send on an XRC_RECV QP: EINVAL");

	/* The same through the extended send API. */
	struct ibv_qp_init_attr_ex ea = { .qp_type = IBV_QPT_XRC_SEND, .send_cq = cq,
					  .cap = { .max_send_wr = 8, .max_send_sge = 1 },
					  .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
					  .pd = pd, .send_ops_flags = IBV_QP_EX_WITH_SEND };
	struct ibv_qp *ini2 = ibv_create_qp_ex(ctx, &ea);
	struct ibv_qp *tgt2 = ibv_create_qp_ex(ctx, &ta);
	REQUIRE(ini2 && tgt2 && xrc_connect(ini2, tgt2->qp_num) == 0 && xrc_connect(tgt2, ini2->qp_num) == 0,
		"a second XRC pair with the extended send API");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(ini2);
	ibv_wr_start(qx);
	qx->wr_id = 2;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qx);
	ibv_wr_set_xrc_srqn(qx, srqn);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)mem, 4);
	CHECK(ibv_wr_complete(qx) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_SUCCESS && wc.wr_id == 2,
	      "ibv_wr_set_xrc_srqn: the send completes");
	CHECK(poll_one(rcq, &wc) && wc.wr_id == 8 && wc.qp_num == tgt2->qp_num && wc.byte_len == 4,
	      "... and lands in the SRQ through the second XRC_RECV QP");

	/* A request for an SRQ outside the domain: the target reports an access error to every
	 * handle (the creator's and the opened one). */
	sw.qp_type.xrc.remote_srqn = 0xABCDEF;
	sw.wr_id = 3;
	CHECK(ibv_post_send(ini, &sw, &bad_s) == 0 && poll_one(cq, &wc) && wc.status == IBV_WC_REM_ACCESS_ERR &&
		      wc.wr_id == 3,
	      "an SRQ number outside the target's domain: IBV_WC_REM_ACCESS_ERR");
	int seen_tgt = 0, seen_opened = 0;
	for (int i = 0; i < 2; i++) {
		struct ibv_async_event ev;
		if (ibv_get_async_event(ctx, &ev))
			break;
		if (ev.event_type == IBV_EVENT_QP_ACCESS_ERR) {
			seen_tgt += ev.element.qp == tgt;
			seen_opened += ev.element.qp == opened;
		}
		ibv_ack_async_event(&ev);
	}
	CHECK(seen_tgt == 1 && seen_opened == 1, "IBV_EVENT_QP_ACCESS_ERR reaches the creator and the opener");
	CHECK(ibv_destroy_cq(rcq) == EBUSY, "ibv_destroy_cq while an XRC SRQ uses it: EBUSY");
	CHECK(ibv_destroy_qp(tgt) == 0 && ibv_close_xrcd(x2) == EBUSY, "destroying the creator's handle of an opened QP");
	CHECK(ibv_destroy_qp(opened) == 0 && ibv_close_xrcd(x2) == 0, "the last handle goes, and its domain handle is free");
	CHECK(ibv_destroy_qp(ini) == 0 && ibv_destroy_qp(ini2) == 0 && ibv_destroy_qp(tgt2) == 0 &&
		      ibv_destroy_srq(srq) == 0 && ibv_destroy_srq(basic) == 0,
	      "XRC teardown: QPs and SRQs");
	CHECK(ibv_close_xrcd(x) == 0 && ibv_close_xrcd(anon) == 0, "ibv_close_xrcd once nothing uses it");
	xa.fd = fd;
	xa.oflags = 0;
	CHECK_NULL_ERR(ibv_open_xrcd(ctx, &xa), EAGAIN, "the last close destroyed the domain");
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(rcq) == 0, "XRC checks: teardown");
	free(mem);
	close(fd);
	unlink(path);
}

static int start_poll_wait(struct ibv_cq_ex *cq)
{
	struct ibv_poll_cq_attr pa = { 0 };
	for (int i = 0; i < 2000000; i++)
		if (ibv_start_poll(cq, &pa) == 0)
			return 1;
	return 0;
}

/* Tag-matching SRQs: IBV_SRQT_TM, ibv_post_srq_ops, ibv_wc_read_tm_info, tm_caps. */
static void test_tag_matching(void)
{
	struct ibv_device_attr_ex dx;
	REQUIRE(ibv_query_device_ex(ctx, NULL, &dx) == 0, "tm: ibv_query_device_ex");
	CHECK((dx.tm_caps.flags & IBV_TM_CAP_RC) && dx.tm_caps.max_num_tags > 0 && dx.tm_caps.max_ops > 0 &&
		      dx.tm_caps.max_sge > 0 &&
		      dx.tm_caps.max_rndv_hdr_size >= sizeof(struct ibv_tmh) + sizeof(struct ibv_rvh),
	      "tm_caps: RC, %u tags, %u ops, %u SGEs, rendezvous headers of %u bytes", dx.tm_caps.max_num_tags,
	      dx.tm_caps.max_ops, dx.tm_caps.max_sge, dx.tm_caps.max_rndv_hdr_size);
	struct ibv_cq_init_attr_ex ca = { .cqe = 64, .wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_TM_INFO };
	struct ibv_cq_ex *tcq = ibv_create_cq_ex(ctx, &ca);
	struct ibv_cq *ccq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	REQUIRE(tcq && ccq, "tm: CQs (IBV_WC_EX_WITH_TM_INFO)");
	struct ibv_srq_init_attr_ex sa = {
		.attr = { .max_wr = 8, .max_sge = 1 },
		.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD | IBV_SRQ_INIT_ATTR_CQ | IBV_SRQ_INIT_ATTR_TM,
		.srq_type = IBV_SRQT_TM,
		.pd = pd,
		.cq = ibv_cq_ex_to_cq(tcq),
		.tm_cap = { .max_num_tags = 8, .max_ops = 2 },
	};
	struct ibv_srq_init_attr_ex bad = sa;
	bad.comp_mask &= ~IBV_SRQ_INIT_ATTR_CQ;
	CHECK_NULL_ERR(ibv_create_srq_ex(ctx, &bad), EINVAL, "TM SRQ without IBV_SRQ_INIT_ATTR_CQ");
	bad = sa;
	bad.tm_cap.max_num_tags = dx.tm_caps.max_num_tags + 1;
	CHECK_NULL_ERR(ibv_create_srq_ex(ctx, &bad), EINVAL, "TM SRQ beyond tm_caps.max_num_tags");
	struct ibv_srq *srq = ibv_create_srq_ex(ctx, &sa);
	REQUIRE(srq && sa.attr.max_wr >= 8, "ibv_create_srq_ex(IBV_SRQT_TM)");
	struct ibv_qp *client = make_qp(ccq, IBV_QPT_RC, NULL);
	struct ibv_qp_init_attr qa = { .send_cq = ccq, .recv_cq = ccq, .srq = srq, .qp_type = IBV_QPT_RC };
	struct ibv_qp *server = ibv_create_qp(pd, &qa);
	REQUIRE(client && server && connect_qp(client, server->qp_num) == 0 &&
			connect_qp(server, client->qp_num) == 0,
		"tm: QPs connected (the server's has no send queue of its own)");
	char *mem = calloc(1, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	REQUIRE(mem && mr, "tm: MR");

	struct ibv_sge tsge = { (uintptr_t)mem, 1024, mr->lkey };
	struct ibv_ops_wr add = { .wr_id = 11, .opcode = IBV_WR_TAG_ADD, .flags = IBV_OPS_SIGNALED,
				  .tm = { .handle = 0xdead,
					  .add = { .recv_wr_id = 21, .sg_list = &tsge, .num_sge = 1,
						   .tag = 0x1234, .mask = ~0ull } } };
	struct ibv_ops_wr *bad_op = NULL;
	int added = ibv_post_srq_ops(srq, &add, &bad_op);
	CHECK(added == 0 && add.tm.handle != 0xdead && add.tm.handle < 8, "IBV_WR_TAG_ADD returns a handle (%u)",
	      add.tm.handle);
	uint32_t handle = add.tm.handle;
	REQUIRE(start_poll_wait(tcq), "the TM SRQ's CQ reports the addition");
	CHECK(tcq->wr_id == 11 && tcq->status == IBV_WC_SUCCESS && ibv_wc_read_opcode(tcq) == IBV_WC_TM_ADD &&
		      !(ibv_wc_read_wc_flags(tcq) & IBV_WC_TM_SYNC_REQ),
	      "IBV_WC_TM_ADD");
	ibv_end_poll(tcq);

	/* An eager message: the TMH from <infiniband/tm_types.h>, then the data. */
	struct ibv_tmh *tmh = (void *)(mem + 4096);
	tmh->opcode = IBV_TMH_EAGER;
	tmh->app_ctx = htobe32(0xabc);
	tmh->tag = htobe64(0x1234);
	memcpy(mem + 4096 + sizeof(*tmh), "payload", 7);
	struct ibv_sge ssge = { (uintptr_t)(mem + 4096), sizeof(*tmh) + 7, mr->lkey };
	struct ibv_send_wr swr = { .wr_id = 1, .sg_list = &ssge, .num_sge = 1, .opcode = IBV_WR_SEND,
				   .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr *bad_s;
	struct ibv_wc wc;
	CHECK(ibv_post_send(client, &swr, &bad_s) == 0 && poll_one(ccq, &wc) && wc.status == IBV_WC_SUCCESS,
	      "tm: the eager SEND completes");
	REQUIRE(start_poll_wait(tcq), "the tagged receive completes");
	struct ibv_wc_tm_info ti = { 0 };
	ibv_wc_read_tm_info(tcq, &ti);
	CHECK(tcq->wr_id == 21 && tcq->status == IBV_WC_SUCCESS && ibv_wc_read_opcode(tcq) == IBV_WC_TM_RECV &&
		      ibv_wc_read_wc_flags(tcq) == (IBV_WC_TM_MATCH | IBV_WC_TM_DATA_VALID) &&
		      ibv_wc_read_byte_len(tcq) == 7 && ibv_wc_read_qp_num(tcq) == server->qp_num &&
		      !memcmp(mem, "payload", 7),
	      "eager match: IBV_WC_TM_RECV with MATCH|DATA_VALID, the data without its TMH");
	CHECK(ti.tag == 0x1234 && ti.priv == 0xabc, "ibv_wc_read_tm_info: tag %#llx priv %#x",
	      (unsigned long long)ti.tag, ti.priv);
	ibv_end_poll(tcq);

	struct ibv_ops_wr del = { .wr_id = 12, .opcode = IBV_WR_TAG_DEL, .flags = IBV_OPS_SIGNALED,
				  .tm = { .handle = handle } };
	CHECK(ibv_post_srq_ops(srq, &del, &bad_op) == 0 && start_poll_wait(tcq) && tcq->wr_id == 12 &&
		      tcq->status == IBV_WC_TM_ERR && ibv_wc_read_opcode(tcq) == IBV_WC_TM_DEL,
	      "IBV_WR_TAG_DEL of a consumed tag: IBV_WC_TM_ERR");
	ibv_end_poll(tcq);

	/* Rendezvous: the device READs the sender's buffer into the tag's, then sends FIN back. */
	struct ibv_sge rsge = { (uintptr_t)(mem + 1024), 2048, mr->lkey };
	struct ibv_ops_wr radd = { .wr_id = 13, .opcode = IBV_WR_TAG_ADD, .flags = IBV_OPS_SIGNALED,
				   .tm = { .add = { .recv_wr_id = 22, .sg_list = &rsge, .num_sge = 1,
						    .tag = 0x99, .mask = ~0ull } } };
	CHECK(ibv_post_srq_ops(srq, &radd, &bad_op) == 0 && start_poll_wait(tcq) && tcq->wr_id == 13,
	      "tm: tag for the rendezvous");
	ibv_end_poll(tcq);
	for (int i = 0; i < 2000; i++)
		mem[6144 + i] = (char)(i * 7 + 1);
	struct ibv_sge fsge = { (uintptr_t)(mem + 5120), 64, mr->lkey };
	struct ibv_recv_wr fwr = { .wr_id = 33, .sg_list = &fsge, .num_sge = 1 };
	struct ibv_recv_wr *bad_r;
	CHECK(ibv_post_recv(client, &fwr, &bad_r) == 0, "tm: the sender waits for FIN");
	tmh->opcode = IBV_TMH_RNDV;
	tmh->tag = htobe64(0x99);
	struct ibv_rvh *rvh = (void *)(mem + 4096 + sizeof(*tmh));
	rvh->va = htobe64((uintptr_t)(mem + 6144));
	rvh->rkey = htobe32(mr->rkey);
	rvh->len = htobe32(2000);
	ssge.length = sizeof(*tmh) + sizeof(*rvh);
	CHECK(ibv_post_send(client, &swr, &bad_s) == 0 && poll_one(ccq, &wc) && wc.status == IBV_WC_SUCCESS,
	      "tm: the rendezvous request is sent");
	int match = start_poll_wait(tcq) && tcq->wr_id == 22 && tcq->status == IBV_WC_SUCCESS &&
		    ibv_wc_read_opcode(tcq) == IBV_WC_TM_RECV && ibv_wc_read_wc_flags(tcq) == IBV_WC_TM_MATCH;
	ibv_end_poll(tcq);
	CHECK(match, "rendezvous: IBV_WC_TM_MATCH when the request arrives");
	int valid = start_poll_wait(tcq) && tcq->wr_id == 22 && tcq->status == IBV_WC_SUCCESS &&
		    ibv_wc_read_wc_flags(tcq) == IBV_WC_TM_DATA_VALID && ibv_wc_read_byte_len(tcq) == 2000;
	ibv_end_poll(tcq);
	CHECK(valid && !memcmp(mem + 1024, mem + 6144, 2000),
	      "rendezvous: IBV_WC_TM_DATA_VALID once the READ placed the sender's data");
	struct ibv_tmh *fin = (void *)(mem + 5120);
	CHECK(poll_one(ccq, &wc) && wc.wr_id == 33 && wc.opcode == IBV_WC_RECV && wc.byte_len == 32 &&
		      fin->opcode == IBV_TMH_FIN && be64toh(fin->tag) == 0x99 &&
		      !memcmp(fin + 1, rvh, sizeof(*rvh)),
	      "rendezvous: the sender receives FIN with the request's TMH and RVH");

	/* max_ops is 2: two unsignaled operations stay outstanding, the third is refused. */
	struct ibv_ops_wr s3 = { .wr_id = 3, .opcode = IBV_WR_TAG_SYNC };
	struct ibv_ops_wr s2 = { .wr_id = 2, .opcode = IBV_WR_TAG_SYNC, .next = &s3 };
	struct ibv_ops_wr s1 = { .wr_id = 1, .opcode = IBV_WR_TAG_SYNC, .next = &s2 };
	bad_op = NULL;
	CHECK_ERR(ibv_post_srq_ops(srq, &s1, &bad_op), ENOMEM, "ibv_post_srq_ops beyond max_ops");
	CHECK(bad_op == &s3, "bad_op names the first operation refused");
	struct ibv_ops_wr bogus = { .wr_id = 4, .opcode = 77 };
	CHECK_ERR(ibv_post_srq_ops(srq, &bogus, &bad_op), EINVAL, "ibv_post_srq_ops with an unknown opcode");
	CHECK(bad_op == &bogus, "bad_op names the unknown opcode");
	struct ibv_srq_init_attr bsa = { .attr = { .max_wr = 2, .max_sge = 1 } };
	struct ibv_srq *basic = ibv_create_srq(pd, &bsa);
	REQUIRE(basic, "tm: a basic SRQ");
	CHECK_ERR(ibv_post_srq_ops(basic, &s3, &bad_op), EINVAL, "ibv_post_srq_ops on a basic SRQ");

	CHECK_ERR(ibv_destroy_cq(ibv_cq_ex_to_cq(tcq)), EBUSY, "ibv_destroy_cq of a TM SRQ's CQ");
	CHECK(ibv_destroy_qp(server) == 0 && ibv_destroy_qp(client) == 0 && ibv_destroy_srq(srq) == 0 &&
		      ibv_destroy_srq(basic) == 0 && ibv_dereg_mr(mr) == 0 &&
		      ibv_destroy_cq(ibv_cq_ex_to_cq(tcq)) == 0 && ibv_destroy_cq(ccq) == 0,
	      "tm: teardown");
	free(mem);
}

int main(void)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	test_device_and_queries();
	test_rc_and_events();
	test_memory_windows();
	test_rereg();
	test_extended_apis();
	test_ud();
	test_device_memory();
	test_null_mr();
	test_parent_domain();
	test_import();
	test_errno();
	test_flow_label();
	test_xrc();
	test_tag_matching();
	CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
	CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
	printf("%d failed\n", failures);
	return failures ? 1 : 0;
}

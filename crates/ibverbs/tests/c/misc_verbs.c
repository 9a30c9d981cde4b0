/*
 * CQ moderation (ibv_modify_cq), null MRs (ibv_alloc_null_mr), flow counters and
 * raw packet QP rate limits (ibv_modify_qp_rate_limit, IBV_QP_RATE_LIMIT) through the real
 * <infiniband/verbs.h> against the drop-in libibverbs.so.1, and the verbs that stay
 * EOPNOTSUPP (ECE, ESP flow actions). Completions are produced by flushing posted receives
 * (moving a QP to the error state), so no traffic timing is involved; counted frames go
 * through the loopback of a network namespace of the program's own (run with unshare -n).
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "check.h"


static struct ibv_context *ctx;
static struct ibv_pd *pd;

static void open_lo(void)
{
	int num = -1;
	struct ibv_device **list = ibv_get_device_list(&num);
	REQUIRE(list && num > 0, "ibv_get_device_list");
	struct ibv_device *dev = NULL;
	for (int i = 0; i < num; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "sv_lo"))
			dev = list[i];
	REQUIRE(dev, "device sv_lo exists");
	ctx = ibv_open_device(dev);
	REQUIRE(ctx, "ibv_open_device");
	ibv_free_device_list(list);
	pd = ibv_alloc_pd(ctx);
	REQUIRE(pd, "ibv_alloc_pd");
}

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* An RC QP in INIT whose receive completions go to cq, with n receives posted: moving it to
 * the error state flushes n completions into cq. */
static struct ibv_qp *qp_with_recvs(struct ibv_cq *cq, struct ibv_mr *mr, int n)
{
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 4, .max_recv_wr = 8,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	REQUIRE(qp, "ibv_create_qp");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_LOCAL_WRITE };
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					      IBV_QP_ACCESS_FLAGS) == 0,
		"QP to INIT");
	for (int i = 0; i < n; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)mr->addr, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *bad;
		REQUIRE(ibv_post_recv(qp, &wr, &bad) == 0, "ibv_post_recv");
	}
	return qp;
}

static void to_error(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "QP to ERR");
}

/* Whether the channel delivers an event within ms milliseconds (acknowledged at once). */
static int event_within(struct ibv_comp_channel *ch, int ms)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	if (poll(&p, 1, ms) != 1)
		return 0;
	struct ibv_cq *cq;
	void *cq_ctx;
	if (ibv_get_cq_event(ch, &cq, &cq_ctx))
		return 0;
	ibv_ack_cq_events(cq, 1);
	return 1;
}

static int drain(struct ibv_cq *cq)
{
	struct ibv_wc wc[8];
	int total = 0, n;
	while ((n = ibv_poll_cq(cq, 8, wc)) > 0)
		total += n;
	return total;
}

static void test_cq_moderation(void)
{
	struct ibv_device_attr_ex dx;
	REQUIRE(ibv_query_device_ex(ctx, NULL, &dx) == 0, "ibv_query_device_ex");
	CHECK(dx.cq_mod_caps.max_cq_count == 65535 && dx.cq_mod_caps.max_cq_period == 4095,
	      "cq_mod_caps = {65535, 4095}");

	static char buf[64];
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr, "ibv_reg_mr");
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	REQUIRE(ch, "ibv_create_comp_channel");
	struct ibv_cq *cq = ibv_create_cq(ctx, 32, NULL, ch, 0);
	REQUIRE(cq, "ibv_create_cq");

	struct ibv_modify_cq_attr m = { .attr_mask = 0 };
	CHECK(ibv_modify_cq(cq, &m) == EINVAL, "ibv_modify_cq with attr_mask 0: EINVAL");
	m.attr_mask = IBV_CQ_ATTR_MODERATE << 1;
	CHECK(ibv_modify_cq(cq, &m) == EINVAL, "ibv_modify_cq with an unknown attr_mask bit: EINVAL");
	m.attr_mask = IBV_CQ_ATTR_MODERATE;
	m.moderate.cq_count = 2;
	m.moderate.cq_period = dx.cq_mod_caps.max_cq_period + 1;
	CHECK(ibv_modify_cq(cq, &m) == EINVAL && errno == EINVAL,
	      "ibv_modify_cq with cq_period above max_cq_period: EINVAL");

	/* Count: 3 completions per event, no period. */
	struct ibv_qp *q1 = qp_with_recvs(cq, mr, 2), *q2 = qp_with_recvs(cq, mr, 1);
	m.moderate.cq_count = 3;
	m.moderate.cq_period = 0;
	CHECK(ibv_modify_cq(cq, &m) == 0, "ibv_modify_cq cq_count 3");
	REQUIRE(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	to_error(q1);
	CHECK(drain(cq) == 2, "two flushed completions");
	CHECK(!event_within(ch, 50), "no event after 2 of 3 completions");
	to_error(q2);
	CHECK(event_within(ch, 5000), "event at the third completion");
	CHECK(drain(cq) == 1, "third completion");

	/* Period: 100 completions or 3 ms. */
	struct ibv_qp *q3 = qp_with_recvs(cq, mr, 1);
	m.moderate.cq_count = 100;
	m.moderate.cq_period = 3000;
	CHECK(ibv_modify_cq(cq, &m) == 0, "ibv_modify_cq cq_count 100 cq_period 3000");
	REQUIRE(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
	double t0 = now_us();
	to_error(q3);
	CHECK(event_within(ch, 5000) && now_us() - t0 >= 3000,
	      "event after the period, short of the count");
	CHECK(drain(cq) == 1, "the held-back completion");

	ibv_destroy_qp(q1);
	ibv_destroy_qp(q2);
	ibv_destroy_qp(q3);
	CHECK(ibv_destroy_cq(cq) == 0, "ibv_destroy_cq");
	ibv_destroy_comp_channel(ch);
	ibv_dereg_mr(mr);
}

static void test_null_mr(void)
{
	struct ibv_mr *null = ibv_alloc_null_mr(pd);
	REQUIRE(null, "ibv_alloc_null_mr");
	CHECK(null->addr == NULL && null->length == SIZE_MAX && null->pd == pd && null->rkey == 0,
	      "null MR: addr NULL, length SIZE_MAX, no rkey");
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	REQUIRE(cq, "ibv_create_cq");
	struct ibv_qp *qp = qp_with_recvs(cq, null, 1);
	to_error(qp);
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(cq, 1, &wc) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR,
	      "a receive into the null MR was posted and flushed");
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	CHECK(ibv_rereg_mr(null, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == IBV_REREG_MR_ERR_INPUT &&
		      errno == EINVAL,
	      "ibv_rereg_mr of the null MR: IBV_REREG_MR_ERR_INPUT, EINVAL");
	CHECK(ibv_dereg_mr(null) == 0, "ibv_dereg_mr of the null MR");
}

static struct ibv_qp *raw_qp(struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RAW_PACKET,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	REQUIRE(qp, "ibv_create_qp raw packet");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PORT) == 0, "raw QP to INIT");
	a.qp_state = IBV_QPS_RTR;
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "raw QP to RTR");
	a.qp_state = IBV_QPS_RTS;
	REQUIRE(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "raw QP to RTS");
	return qp;
}

struct counted_flow {
	struct ibv_flow_attr attr;
	struct ibv_flow_spec_eth eth;
	struct ibv_flow_spec_counter_action count;
} __attribute__((packed, aligned(4)));

static int wait_completions(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
	int got = 0;
	for (int i = 0; i < 200000 && got < n; i++) {
		int k = ibv_poll_cq(cq, n - got, wc + got);
		if (k < 0)
			return -1;
		got += k;
		if (!k)
			usleep(10);
	}
	return got;
}

/* Runs in a network namespace of its own: the loopback carries only this program's frames. */
static void test_counters(void)
{
	struct ibv_counters_init_attr ia = { .comp_mask = 1 };
	errno = 0;
	CHECK(!ibv_create_counters(ctx, &ia) && errno == EOPNOTSUPP,
	      "ibv_create_counters with an unknown comp_mask: NULL, EOPNOTSUPP");
	ia.comp_mask = 0;
	struct ibv_counters *c = ibv_create_counters(ctx, &ia);
	REQUIRE(c && c->context == ctx, "ibv_create_counters");

	struct ibv_counter_attach_attr at = { .counter_desc = 2, .index = 0 };
	CHECK(ibv_attach_counters_point_flow(c, &at, NULL) == ENOTSUP,
	      "attach of an unknown counter_desc: ENOTSUP");
	at.counter_desc = IBV_COUNTER_PACKETS;
	at.comp_mask = 1;
	CHECK(ibv_attach_counters_point_flow(c, &at, NULL) == EOPNOTSUPP,
	      "attach with an unknown comp_mask: EOPNOTSUPP");
	at.comp_mask = 0;
	CHECK(ibv_attach_counters_point_flow(c, &at, NULL) == 0, "attach IBV_COUNTER_PACKETS at 0");
	at.counter_desc = IBV_COUNTER_BYTES;
	at.index = 1;
	CHECK(ibv_attach_counters_point_flow(c, &at, NULL) == 0, "attach IBV_COUNTER_BYTES at 1");
	uint64_t v[3] = { 9, 9, 9 };
	CHECK(ibv_read_counters(c, v, 3, 0) == 0 && !v[0] && !v[1] && !v[2],
	      "ibv_read_counters: cleared at creation, 0 without a point");

	struct ibv_cq *cq = ibv_create_cq(ctx, 32, NULL, NULL, 0);
	REQUIRE(cq, "ibv_create_cq");
	struct ibv_qp *tx = raw_qp(cq), *rx = raw_qp(cq);
	static uint8_t buf[16 * 2048];
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr, "ibv_reg_mr");
	for (int i = 0; i < 8; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf + i * 2048, .length = 2048,
				       .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *bad;
		REQUIRE(ibv_post_recv(rx, &wr, &bad) == 0, "ibv_post_recv");
	}
	struct counted_flow f = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(f), .num_of_specs = 2,
			  .port = 1 },
		.eth = { .type = IBV_FLOW_SPEC_ETH, .size = sizeof(struct ibv_flow_spec_eth),
			 .val = { .ether_type = htons(0x88b5) },
			 .mask = { .ether_type = 0xffff } },
		.count = { .type = IBV_FLOW_SPEC_ACTION_COUNT,
			   .size = sizeof(struct ibv_flow_spec_counter_action), .counters = c },
	};
	struct ibv_flow *flow = ibv_create_flow(rx, &f.attr);
	REQUIRE(flow, "ibv_create_flow with IBV_FLOW_SPEC_ACTION_COUNT");
	at.counter_desc = IBV_COUNTER_PACKETS;
	at.index = 2;
	CHECK(ibv_attach_counters_point_flow(c, &at, NULL) == EBUSY, "attach once bound: EBUSY");
	CHECK(ibv_attach_counters_point_flow(c, &at, flow) == ENOTSUP,
	      "attach to an existing flow (dynamic mode): ENOTSUP");
	CHECK(ibv_destroy_counters(c) == EBUSY, "ibv_destroy_counters while bound: EBUSY");

	/* Three frames of the counted type (60, 100, 1000 bytes) and one of another type. */
	size_t lens[4] = { 60, 100, 1000, 80 };
	for (int i = 0; i < 4; i++) {
		uint8_t *fr = buf + (10 + i % 4) * 2048;
		memset(fr, 0, lens[i]);
		fr[0] = 0x02, fr[5] = 0x44, fr[6] = 0x02, fr[11] = 0x45;
		fr[12] = 0x88, fr[13] = i == 3 ? 0xb6 : 0xb5;
		struct ibv_sge sge = { .addr = (uintptr_t)fr, .length = lens[i], .lkey = mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 100 + i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
				   *bad;
		REQUIRE(ibv_post_send(tx, &wr, &bad) == 0, "ibv_post_send raw frame");
	}
	struct ibv_wc wc[8];
	CHECK(wait_completions(cq, 7, wc) == 7, "4 sends and 3 receives complete");
	uint64_t bytes = 0;
	int recvs = 0;
	for (int i = 0; i < 7; i++)
		if (wc[i].opcode == IBV_WC_RECV)
			recvs++, bytes += wc[i].byte_len;
	CHECK(recvs == 3 && bytes == 1160, "the counted flow took 3 frames, 1160 bytes");
	CHECK(ibv_read_counters(c, v, 2, IBV_READ_COUNTERS_ATTR_PREFER_CACHED) == 0 && v[0] == 3 &&
		      v[1] == 1160,
	      "ibv_read_counters (PREFER_CACHED): 3 packets, 1160 bytes");
	v[0] = 0;
	CHECK(ibv_read_counters(c, v, 1, 0) == 0 && v[0] == 3, "ibv_read_counters ncounters 1");
	CHECK(ibv_read_counters(c, v, 2, 0x80) == EINVAL, "ibv_read_counters unknown flag: EINVAL");

	CHECK(ibv_destroy_flow(flow) == 0, "ibv_destroy_flow");
	CHECK(ibv_destroy_counters(c) == 0, "ibv_destroy_counters once unbound");
	ibv_destroy_qp(tx);
	ibv_destroy_qp(rx);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
}

static void test_rate_limit(void)
{
	struct ibv_device_attr_ex dx;
	REQUIRE(ibv_query_device_ex(ctx, NULL, &dx) == 0, "ibv_query_device_ex");
	struct ibv_packet_pacing_caps pc = dx.packet_pacing_caps;
	CHECK(pc.supported_qpts == 1u << IBV_QPT_RAW_PACKET && pc.qp_rate_limit_min >= 1 &&
		      pc.qp_rate_limit_min <= pc.qp_rate_limit_max,
	      "packet_pacing_caps: raw packet QPs, min %u max %u kbps", pc.qp_rate_limit_min,
	      pc.qp_rate_limit_max);

	struct ibv_cq *cq = ibv_create_cq(ctx, 32, NULL, NULL, 0);
	REQUIRE(cq, "ibv_create_cq");
	static char small[64];
	struct ibv_mr *smr = ibv_reg_mr(pd, small, sizeof(small), IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(smr, "ibv_reg_mr");
	struct ibv_qp *rc = qp_with_recvs(cq, smr, 0);
	struct ibv_qp_rate_limit_attr rl = { .rate_limit = 1000 };
	CHECK(ibv_modify_qp_rate_limit(rc, &rl) == EINVAL, "ibv_modify_qp_rate_limit on RC: EINVAL");
	struct ibv_qp *qp = raw_qp(cq);
	rl.comp_mask = 1;
	CHECK(ibv_modify_qp_rate_limit(qp, &rl) == EINVAL, "unknown comp_mask: EINVAL");
	rl.comp_mask = 0;
	rl.rate_limit = pc.qp_rate_limit_max + 1;
	CHECK(ibv_modify_qp_rate_limit(qp, &rl) == EINVAL, "rate above qp_rate_limit_max: EINVAL");
	rl.rate_limit = 0;
	rl.max_burst_sz = 4096;
	CHECK(ibv_modify_qp_rate_limit(qp, &rl) == EINVAL, "burst without a rate: EINVAL");

	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTS, .rate_limit = 2000 };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_RATE_LIMIT) == 0,
	      "ibv_modify_qp RTS->RTS with IBV_QP_RATE_LIMIT");
	struct ibv_qp_init_attr qia;
	memset(&a, 0, sizeof(a));
	CHECK(ibv_query_qp(qp, &a, IBV_QP_RATE_LIMIT, &qia) == 0 && a.rate_limit == 2000,
	      "ibv_query_qp reports rate_limit 2000");

	/* 400 kbit/s = 50 kB/s, one-frame bursts: five 1000-byte frames take 80 ms after the first. */
	rl.rate_limit = 400;
	rl.max_burst_sz = 1000;
	rl.typical_pkt_sz = 1000;
	CHECK(ibv_modify_qp_rate_limit(qp, &rl) == 0, "ibv_modify_qp_rate_limit 400 kbps");
	static uint8_t fr[1000];
	memset(fr, 0, sizeof(fr));
	fr[0] = 0x02, fr[5] = 0x46, fr[6] = 0x02, fr[11] = 0x47, fr[12] = 0x88, fr[13] = 0xb7;
	struct ibv_mr *mr = ibv_reg_mr(pd, fr, sizeof(fr), IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr, "ibv_reg_mr");
	double t0 = now_us();
	for (int i = 0; i < 5; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)fr, .length = sizeof(fr), .lkey = mr->lkey };
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
				   *bad;
		REQUIRE(ibv_post_send(qp, &wr, &bad) == 0, "ibv_post_send");
	}
	struct ibv_wc wc[5];
	int n = wait_completions(cq, 5, wc);
	double took = now_us() - t0;
	CHECK(n == 5 && wc[4].status == IBV_WC_SUCCESS && took >= 79000,
	      "5 paced frames completed after %.1f ms (at least 80)", took / 1000);

	ibv_destroy_qp(qp);
	ibv_destroy_qp(rc);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_dereg_mr(smr);
}

static void test_not_offered(void)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	REQUIRE(cq, "ibv_create_cq");
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 1, .max_recv_wr = 1,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	REQUIRE(qp, "ibv_create_qp");
	struct ibv_ece ece = { .vendor_id = 0x15b3, .options = 1 };
	CHECK(ibv_query_ece(qp, &ece) == EOPNOTSUPP, "ibv_query_ece: EOPNOTSUPP (vendor options)");
	CHECK(ibv_set_ece(qp, &ece) == EOPNOTSUPP, "ibv_set_ece: EOPNOTSUPP (vendor options)");
	struct ibv_flow_action_esp_attr esp = { 0 };
	errno = 0;
	CHECK(!ibv_create_flow_action_esp(ctx, &esp) && errno == EOPNOTSUPP,
	      "ibv_create_flow_action_esp: NULL, EOPNOTSUPP (IPsec crypto offload)");
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
}

int main(void)
{
	open_lo();
	test_cq_moderation();
	test_null_mr();
	test_counters();
	test_rate_limit();
	test_not_offered();
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("%d failed\n", failures);
	return failures ? 1 : 0;
}

/*
 * Flow rules on UD QPs through the real <infiniband/verbs.h> on device sv_lo: a RoCEv2 UD
 * datagram whose IPv4 and UDP headers match a rule reaches the rule's QP as well as the QP it
 * is addressed to; sniffers see every datagram; TCP specs and other ports do not match;
 * destroying a rule stops its copies; and the errno conventions of ibv_create_flow(3).
 * The UDP port the datagrams travel to is this process's: the base port (SOFTVERBS_UDP_PORT,
 * 4791 by default) plus the slot in bits 16..24 of every QP number.
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

#define QKEY 0x11111111u
#define SLOT 1024 /* bytes of memory per receive */

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_mr *mr;
static uint8_t *mem;
static int next_slot;

struct ud {
	struct ibv_cq *cq;
	struct ibv_qp *qp;
};

/* A UD QP in RTS with Q_Key QKEY and 8 receives, each into a slot of its own (wr_id = slot). */
static struct ud ud_qp(void)
{
	struct ud u = { .cq = ibv_create_cq(ctx, 32, NULL, NULL, 0) };
	struct ibv_qp_init_attr ia = { .send_cq = u.cq, .recv_cq = u.cq, .qp_type = IBV_QPT_UD,
				       .cap = { .max_send_wr = 8, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	u.qp = u.cq ? ibv_create_qp(pd, &ia) : NULL;
	if (!u.qp)
		return u;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = QKEY };
	if (ibv_modify_qp(u.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		goto fail;
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(u.qp, &a, IBV_QP_STATE))
		goto fail;
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 1;
	if (ibv_modify_qp(u.qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
		goto fail;
	for (int i = 0; i < 8; i++, next_slot++) {
		struct ibv_sge sge = { .addr = (uintptr_t)(mem + next_slot * SLOT), .length = SLOT, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = next_slot, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(u.qp, &wr, &bad))
			goto fail;
	}
	return u;
fail:
	ibv_destroy_qp(u.qp);
	u.qp = NULL;
	return u;
}

/* Completions of `cq` within `ms` milliseconds, stopping once `want` arrived; the first in *wc. */
static int poll_for(struct ibv_cq *cq, int want, int ms, struct ibv_wc *wc)
{
	int got = 0;
	struct ibv_wc w;
	for (int t = 0; t < ms * 10 && got < want; t++) {
		while (ibv_poll_cq(cq, 1, &w) == 1) {
			if (got++ == 0)
				*wc = w;
		}
		if (got < want)
			usleep(100);
	}
	while (ibv_poll_cq(cq, 1, &w) == 1)
		got++;
	return got;
}

/* Sends `msg` from `from` to QP `dest` through `ah`; 0 once the send completed. */
static int send_to(struct ud *from, struct ibv_ah *ah, uint32_t dest, const char *msg)
{
	size_t len = strlen(msg);
	uint8_t *buf = mem + 500 * SLOT;
	memcpy(buf, msg, len);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED,
				  .wr.ud = { .ah = ah, .remote_qpn = dest, .remote_qkey = QKEY } }, *bad;
	if (ibv_post_send(from->qp, &wr, &bad))
		return -1;
	struct ibv_wc wc;
	return poll_for(from->cq, 1, 10000, &wc) == 1 && wc.status == IBV_WC_SUCCESS ? 0 : -1;
}

/* The payload of a receive completion matches `msg`. */
static int payload_is(const struct ibv_wc *wc, const char *msg)
{
	size_t len = strlen(msg);
	return wc->status == IBV_WC_SUCCESS && wc->opcode == IBV_WC_RECV && wc->byte_len == 40 + len &&
	       !memcmp(mem + wc->wr_id * SLOT + 40, msg, len);
}

struct ip_udp_flow {
	struct ibv_flow_attr attr;
	struct ibv_flow_spec_ipv4 ip;
	struct ibv_flow_spec_tcp_udp l4;
};

static struct ip_udp_flow ip_udp(enum ibv_flow_spec_type l4, uint16_t dst_port)
{
	struct ip_udp_flow f = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(f), .num_of_specs = 2, .port = 1 },
		.ip = { .type = IBV_FLOW_SPEC_IPV4, .size = sizeof(struct ibv_flow_spec_ipv4),
			.val = { .dst_ip = htonl(INADDR_LOOPBACK) }, .mask = { .dst_ip = 0xffffffff } },
		.l4 = { .type = l4, .size = sizeof(struct ibv_flow_spec_tcp_udp),
			.val = { .dst_port = htons(dst_port) }, .mask = { .dst_port = 0xffff } },
	};
	return f;
}

int main(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_device *dev = NULL;
	for (int i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "sv_lo"))
			dev = list[i];
	REQUIRE(dev, "device sv_lo");
	ctx = ibv_open_device(dev);
	REQUIRE(ctx, "ibv_open_device");
	ibv_free_device_list(list);
	pd = ibv_alloc_pd(ctx);
	REQUIRE(pd, "ibv_alloc_pd");
	mem = aligned_alloc(4096, 1 << 20);
	mr = ibv_reg_mr(pd, mem, 1 << 20, IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr, "ibv_reg_mr");

	struct ud a = ud_qp(), b = ud_qp(), c = ud_qp(), d = ud_qp(), e = ud_qp(), s = ud_qp();
	REQUIRE(a.qp && b.qp && c.qp && d.qp && e.qp && s.qp, "six UD QPs in RTS");
	const char *base_env = getenv("SOFTVERBS_UDP_PORT");
	uint16_t port = (base_env ? atoi(base_env) : 4791) + (b.qp->qp_num >> 16);

	union ibv_gid gid, want = { .raw = { [10] = 0xff, [11] = 0xff, [12] = 127, [15] = 1 } };
	int sgid = -1;
	for (int i = 0; i < 16 && sgid < 0; i++)
		if (!ibv_query_gid(ctx, 1, i, &gid) && !memcmp(&gid, &want, sizeof(gid)))
			sgid = i;
	REQUIRE(sgid >= 0, "GID ::ffff:127.0.0.1");
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
				  .grh = { .dgid = want, .sgid_index = sgid, .hop_limit = 64 } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	REQUIRE(ah, "ibv_create_ah to 127.0.0.1");

	struct ip_udp_flow fc = ip_udp(IBV_FLOW_SPEC_UDP, port), fd = ip_udp(IBV_FLOW_SPEC_UDP, port + 1),
			   fe = ip_udp(IBV_FLOW_SPEC_TCP, port);
	struct ibv_flow *flow_c = ibv_create_flow(c.qp, (struct ibv_flow_attr *)(void *)&fc);
	REQUIRE(flow_c, "ibv_create_flow on a UD QP: IPv4 127.0.0.1, UDP port %u", port);
	struct ibv_flow *flow_d = ibv_create_flow(d.qp, (struct ibv_flow_attr *)(void *)&fd);
	struct ibv_flow *flow_e = ibv_create_flow(e.qp, (struct ibv_flow_attr *)(void *)&fe);
	REQUIRE(flow_d && flow_e, "rules for another UDP port and for TCP");
	struct ibv_flow_attr sniff = { .type = IBV_FLOW_ATTR_SNIFFER, .size = sizeof(sniff), .port = 1 };
	struct ibv_flow *flow_s = ibv_create_flow(s.qp, &sniff);
	REQUIRE(flow_s, "IBV_FLOW_ATTR_SNIFFER on a UD QP");

	struct ibv_wc wc;
	REQUIRE(send_to(&a, ah, b.qp->qp_num, "hello") == 0, "UD SEND to QP b");
	CHECK(poll_for(b.cq, 1, 10000, &wc) == 1 && payload_is(&wc, "hello"), "the addressed QP receives it once");
	CHECK(poll_for(c.cq, 1, 10000, &wc) == 1 && payload_is(&wc, "hello") && wc.src_qp == a.qp->qp_num &&
		      wc.qp_num == c.qp->qp_num && (wc.wc_flags & IBV_WC_GRH),
	      "the matching rule's QP receives one copy, with the sender's QP and a GRH");
	CHECK(poll_for(s.cq, 1, 10000, &wc) == 1 && payload_is(&wc, "hello"), "the sniffer receives one copy");
	CHECK(poll_for(d.cq, 1, 50, &wc) == 0, "another UDP port: no copy");
	CHECK(poll_for(e.cq, 1, 50, &wc) == 0, "a TCP spec never matches RoCE traffic");
	CHECK(ibv_destroy_qp(c.qp) == EBUSY, "ibv_destroy_qp with a flow attached: EBUSY");

	CHECK(ibv_destroy_flow(flow_s) == 0 && ibv_destroy_flow(flow_c) == 0, "ibv_destroy_flow");
	REQUIRE(send_to(&a, ah, b.qp->qp_num, "again") == 0, "UD SEND to QP b again");
	CHECK(poll_for(b.cq, 1, 10000, &wc) == 1 && payload_is(&wc, "again"), "the addressed QP receives it");
	CHECK(poll_for(s.cq, 1, 50, &wc) == 0 && poll_for(c.cq, 1, 50, &wc) == 0,
	      "destroyed rules deliver nothing");

	struct {
		struct ibv_flow_attr attr;
		struct ibv_flow_spec_action_tag tag;
	} tagged = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(tagged), .num_of_specs = 1, .port = 1 },
		.tag = { .type = IBV_FLOW_SPEC_ACTION_TAG, .size = sizeof(struct ibv_flow_spec_action_tag), .tag_id = 1 },
	};
	errno = 0;
	CHECK(!ibv_create_flow(c.qp, (struct ibv_flow_attr *)(void *)&tagged) && errno == EOPNOTSUPP, "a TAG action on a UD QP: NULL, EOPNOTSUPP");
	sniff.port = 2;
	errno = 0;
	CHECK(!ibv_create_flow(c.qp, &sniff) && errno == EINVAL, "port 2: NULL, EINVAL");
	sniff.port = 1;
	fc.attr.type = IBV_FLOW_ATTR_SNIFFER;
	errno = 0;
	CHECK(!ibv_create_flow(c.qp, (struct ibv_flow_attr *)(void *)&fc) && errno == EINVAL, "a sniffer with specs: NULL, EINVAL");
	struct ibv_qp_init_attr ra = { .send_cq = a.cq, .recv_cq = a.cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *rc = ibv_create_qp(pd, &ra);
	errno = 0;
	CHECK(rc && !ibv_create_flow(rc, &sniff) && errno == EINVAL, "a flow on an RC QP: NULL, EINVAL");

	CHECK(ibv_destroy_flow(flow_d) == 0 && ibv_destroy_flow(flow_e) == 0, "the other rules destroyed");
	CHECK(ibv_destroy_qp(rc) == 0 && ibv_destroy_qp(a.qp) == 0 && ibv_destroy_qp(b.qp) == 0 &&
		      ibv_destroy_qp(c.qp) == 0 && ibv_destroy_qp(d.qp) == 0 && ibv_destroy_qp(e.qp) == 0 &&
		      ibv_destroy_qp(s.qp) == 0,
	      "every QP destroyed once its rules are");
	ibv_destroy_ah(ah);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("%d failed\n", failures);
	return failures != 0;
}

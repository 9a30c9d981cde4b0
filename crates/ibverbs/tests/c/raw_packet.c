/*
 * Raw packet QPs through the real <infiniband/verbs.h> on device sv_lo: the inline flow, WQ
 * and indirection-table wrappers, RSS QPs from ibv_create_qp_ex, ibv_wc_read_flow_tag and the
 * device capabilities. Frames go out of and back into the loopback interface through the
 * library's packet socket. Run as "raw_packet noperm" without CAP_NET_RAW it checks EPERM.
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <arpa/inet.h>
#include <linux/capability.h>
#include <sys/syscall.h>
#include <endian.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static const uint8_t ms_key[40] = {
	0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67, 0x25, 0x3d, 0x43, 0xa3,
	0x8f, 0xb0, 0xd0, 0xca, 0x2b, 0xcb, 0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3,
	0x80, 0x30, 0xf2, 0x0c, 0x6a, 0x42, 0xb7, 0x3b, 0xbe, 0xac, 0x01, 0xfa,
};

/* The Toeplitz hash, bit by bit over a 64-bit window of the key. */
static uint32_t toeplitz(const uint8_t *key, int key_len, const uint8_t *in, int len)
{
	uint32_t hash = 0;
	for (int i = 0; i < len * 8; i++) {
		if (in[i / 8] & (0x80 >> (i % 8))) {
			uint32_t w = 0;
			for (int j = 0; j < 32; j++) {
				int k = i + j;
				int bit = k / 8 < key_len ? (key[k / 8] >> (7 - k % 8)) & 1 : 0;
				w = (w << 1) | bit;
			}
			hash ^= w;
		}
	}
	return hash;
}

/* Raises or drops CAP_NET_RAW in this thread's effective set (it stays permitted). */
static int net_raw_effective(int on)
{
	struct __user_cap_header_struct h = { .version = _LINUX_CAPABILITY_VERSION_3, .pid = 0 };
	struct __user_cap_data_struct d[2];
	if (syscall(SYS_capget, &h, d))
		return -1;
	if (on)
		d[0].effective |= 1u << CAP_NET_RAW;
	else
		d[0].effective &= ~(1u << CAP_NET_RAW);
	return syscall(SYS_capset, &h, d);
}

static struct ibv_context *ctx;
static struct ibv_pd *pd;

static struct ibv_qp *raw_qp(struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RAW_PACKET,
		.cap = { .max_send_wr = 32, .max_recv_wr = 64, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return ibv_create_qp(pd, &ia);
}

static int to_rts(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PORT))
		return -1;
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		return -1;
	a.qp_state = IBV_QPS_RTS;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

static int send_frame(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *mr, void *buf, size_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 0x5e, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		return -1;
	struct ibv_wc wc;
	for (int i = 0; i < 100000; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n)
			return n == 1 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND ? 0 : -1;
		usleep(10);
	}
	return -1;
}

struct eth_tag_flow {
	struct ibv_flow_attr attr;
	struct ibv_flow_spec_eth eth;
	struct ibv_flow_spec_action_tag tag;
} __attribute__((packed, aligned(4)));

struct udp_flow {
	struct ibv_flow_attr attr;
	struct ibv_flow_spec_ipv4 ip;
	struct ibv_flow_spec_tcp_udp udp;
} __attribute__((packed, aligned(4)));

static size_t udp_frame(uint8_t *f, uint16_t sport, uint16_t dport)
{
	memset(f, 0, 14);
	f[12] = 0x08;
	uint8_t *ip = f + 14;
	memset(ip, 0, 20);
	ip[0] = 0x45;
	ip[3] = 20 + 8 + 4;
	ip[8] = 64;
	ip[9] = 17;
	ip[12] = 127, ip[15] = 1, ip[16] = 127, ip[19] = 1;
	uint32_t sum = 0;
	for (int i = 0; i < 20; i += 2)
		sum += (ip[i] << 8) | ip[i + 1];
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	ip[10] = ~sum >> 8, ip[11] = ~sum & 0xff;
	uint8_t *u = ip + 20;
	u[0] = sport >> 8, u[1] = sport & 0xff, u[2] = dport >> 8, u[3] = dport & 0xff;
	u[4] = 0, u[5] = 12, u[6] = 0, u[7] = 0; /* no UDP checksum */
	memcpy(u + 8, "rss!", 4);
	return 14 + 20 + 12;
}

static void noperm(void)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	REQUIRE(cq, "ibv_create_cq");
	errno = 0;
	CHECK(!raw_qp(cq) && errno == EPERM, "raw QP without CAP_NET_RAW: NULL, EPERM");
	struct ibv_wq_init_attr wa = { .wq_type = IBV_WQT_RQ, .max_wr = 4, .max_sge = 1, .pd = pd, .cq = cq };
	struct ibv_wq *wq = ibv_create_wq(ctx, &wa);
	struct ibv_rwq_ind_table_init_attr ta = { .log_ind_tbl_size = 0, .ind_tbl = &wq };
	struct ibv_rwq_ind_table *t = wq ? ibv_create_rwq_ind_table(ctx, &ta) : NULL;
	struct ibv_qp_init_attr_ex qa = {
		.qp_type = IBV_QPT_RAW_PACKET, .pd = pd, .rwq_ind_tbl = t,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH,
		.rx_hash_conf = { .rx_hash_function = IBV_RX_HASH_FUNC_TOEPLITZ, .rx_hash_key_len = 40,
				  .rx_hash_key = (uint8_t *)ms_key,
				  .rx_hash_fields_mask = IBV_RX_HASH_SRC_IPV4 | IBV_RX_HASH_DST_IPV4 },
	};
	errno = 0;
	CHECK(t && !ibv_create_qp_ex(ctx, &qa) && errno == EPERM, "RSS QP without CAP_NET_RAW: NULL, EPERM");
	CHECK(ibv_destroy_rwq_ind_table(t) == 0 && ibv_destroy_wq(wq) == 0 && ibv_destroy_cq(cq) == 0,
	      "teardown");
}

int main(int argc, char **argv)
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
	if (argc > 1 && !strcmp(argv[1], "noperm")) {
		noperm();
		printf("%d failed\n", failures);
		return failures != 0;
	}

	struct ibv_device_attr_ex dx;
	CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0 &&
		      (dx.orig_attr.device_cap_flags & IBV_DEVICE_MANAGED_FLOW_STEERING),
	      "IBV_DEVICE_MANAGED_FLOW_STEERING");
	CHECK(dx.rss_caps.supported_qpts == 1u << IBV_QPT_RAW_PACKET &&
		      dx.rss_caps.rx_hash_function == IBV_RX_HASH_FUNC_TOEPLITZ &&
		      dx.rss_caps.max_rwq_indirection_table_size >= 4 && dx.max_wq_type_rq > 0 &&
		      dx.rss_caps.rx_hash_fields_mask == 0xff,
	      "rss_caps: raw packet QPs, Toeplitz, table size %u", dx.rss_caps.max_rwq_indirection_table_size);

	struct ibv_cq *scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq_init_attr_ex cxa = { .cqe = 256, .wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_FLOW_TAG };
	struct ibv_cq_ex *rcq = ibv_create_cq_ex(ctx, &cxa);
	REQUIRE(scq && rcq, "CQs, one extended with IBV_WC_EX_WITH_FLOW_TAG");
	struct ibv_qp *tx = raw_qp(scq), *rx = raw_qp(ibv_cq_ex_to_cq(rcq));
	REQUIRE(tx && rx && tx->qp_type == IBV_QPT_RAW_PACKET, "ibv_create_qp(IBV_QPT_RAW_PACKET)");
	struct ibv_qp_attr qa = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 1 };
	CHECK(ibv_modify_qp(tx, &qa, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_QKEY) == EINVAL,
	      "RESET->INIT with a Q_Key: EINVAL");
	CHECK(to_rts(tx) == 0 && to_rts(rx) == 0, "INIT with the port, then RTR and RTS with the state only");

	size_t len = 1 << 20;
	uint8_t *mem = aligned_alloc(4096, len);
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, len, IBV_ACCESS_LOCAL_WRITE);
	REQUIRE(mr, "ibv_reg_mr");

	/* An ETH rule with a tag; the tagged frame comes back through the CQ's read_flow_tag. */
	struct eth_tag_flow ef = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(ef), .priority = 2, .num_of_specs = 2,
			  .port = 1 },
		.eth = { .type = IBV_FLOW_SPEC_ETH, .size = sizeof(struct ibv_flow_spec_eth),
			 .val = { .ether_type = htons(0x88b5) }, .mask = { .ether_type = 0xffff } },
		.tag = { .type = IBV_FLOW_SPEC_ACTION_TAG, .size = sizeof(struct ibv_flow_spec_action_tag),
			 .tag_id = 0x7a7 },
	};
	struct ibv_flow *flow = ibv_create_flow(rx, (struct ibv_flow_attr *)(void *)&ef);
	REQUIRE(flow, "ibv_create_flow: ETH spec and TAG action, packed");
	CHECK(ibv_destroy_qp(rx) == EBUSY, "ibv_destroy_qp with a flow attached: EBUSY");
	struct ibv_sge rsge = { .addr = (uintptr_t)mem, .length = 2048, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 0xf1, .sg_list = &rsge, .num_sge = 1 }, *rbad;
	CHECK(ibv_post_recv(rx, &rwr, &rbad) == 0, "ibv_post_recv on the raw QP");
	uint8_t *frame = mem + 4096;
	memset(frame, 0, 14);
	frame[0] = 0x02, frame[5] = 0x42, frame[6] = 0x02, frame[11] = 0x41, frame[12] = 0x88, frame[13] = 0xb5;
	snprintf((char *)frame + 14, 64, "raw loopback from pid %d", (int)getpid());
	size_t flen = 14 + 64;
	CHECK(send_frame(tx, scq, mr, frame, flen) == 0, "a frame sent from a raw QP completes");
	struct ibv_poll_cq_attr pa = {};
	int got = ENOENT;
	for (int i = 0; i < 200000 && got == ENOENT; i++) {
		got = ibv_start_poll(rcq, &pa);
		if (got == ENOENT)
			usleep(10);
	}
	CHECK(got == 0 && rcq->status == IBV_WC_SUCCESS && rcq->wr_id == 0xf1 &&
		      ibv_wc_read_opcode(rcq) == IBV_WC_RECV && ibv_wc_read_byte_len(rcq) == flen &&
		      ibv_wc_read_flow_tag(rcq) == 0x7a7 && !memcmp(mem, frame, flen),
	      "the frame arrives whole, with its flow tag");
	if (got == 0)
		ibv_end_poll(rcq);

	/* Rule checks. */
	ef.attr.port = 2;
	errno = 0;
	CHECK(!ibv_create_flow(rx, (struct ibv_flow_attr *)(void *)&ef) && errno == EINVAL, "port 2: NULL, EINVAL");
	ef.attr.port = 1;
	ef.eth.size = 20;
	errno = 0;
	CHECK(!ibv_create_flow(rx, (struct ibv_flow_attr *)(void *)&ef) && errno == EINVAL, "a spec shorter than its struct: EINVAL");
	ef.eth.size = sizeof(struct ibv_flow_spec_eth);
	struct ibv_cq *ocq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr ua = { .send_cq = ocq, .recv_cq = ocq, .qp_type = IBV_QPT_UD,
				       .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *ud = ibv_create_qp(pd, &ua);
	ua.qp_type = IBV_QPT_RC;
	struct ibv_qp *rc = ibv_create_qp(pd, &ua);
	errno = 0;
	CHECK(!ibv_create_flow(ud, (struct ibv_flow_attr *)(void *)&ef) && errno == EOPNOTSUPP,
	      "a TAG action on a UD QP (no flow tag in UD completions): EOPNOTSUPP");
	errno = 0;
	CHECK(!ibv_create_flow(rc, (struct ibv_flow_attr *)(void *)&ef) && errno == EINVAL, "a flow on an RC QP: EINVAL");
	CHECK(ibv_destroy_qp(ud) == 0 && ibv_destroy_qp(rc) == 0, "UD and RC QPs destroyed");
	REQUIRE(net_raw_effective(0) == 0, "CAP_NET_RAW dropped from the effective set");
	errno = 0;
	CHECK(!ibv_create_flow(rx, (struct ibv_flow_attr *)(void *)&ef) && errno == EPERM,
	      "ibv_create_flow without CAP_NET_RAW: NULL, EPERM");
	errno = 0;
	CHECK(!raw_qp(scq) && errno == EPERM, "ibv_create_qp(RAW_PACKET) without CAP_NET_RAW: NULL, EPERM");
	REQUIRE(net_raw_effective(1) == 0, "CAP_NET_RAW raised again");
	CHECK(ibv_destroy_flow(flow) == 0 && ibv_destroy_qp(rx) == 0, "ibv_destroy_flow, then the QP");

	/* TSO: a header block and a TCP payload cut into MSS-sized frames. */
	CHECK(dx.tso_caps.max_tso >= 65536 && dx.tso_caps.supported_qpts == 1u << IBV_QPT_RAW_PACKET,
	      "tso_caps: raw packet QPs, max_tso %u", dx.tso_caps.max_tso);
	struct ibv_qp_init_attr_ex txa = {
		.send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RAW_PACKET, .pd = pd,
		.cap = { .max_send_wr = 8, .max_send_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_MAX_TSO_HEADER, .max_tso_header = 64,
	};
	struct ibv_qp *tso_tx = ibv_create_qp_ex(ctx, &txa);
	struct ibv_qp *tso_rx = raw_qp(ibv_cq_ex_to_cq(rcq));
	REQUIRE(tso_tx && tso_rx && to_rts(tso_tx) == 0 && to_rts(tso_rx) == 0,
		"a raw QP with max_tso_header from ibv_create_qp_ex");
	uint16_t tport = 20000 + getpid() % 20000;
	struct {
		struct ibv_flow_attr attr;
		struct ibv_flow_spec_tcp_udp tcp;
	} __attribute__((packed, aligned(4))) tf = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(tf), .num_of_specs = 1, .port = 1 },
		.tcp = { .type = IBV_FLOW_SPEC_TCP, .size = sizeof(struct ibv_flow_spec_tcp_udp),
			 .val = { .dst_port = htons(tport) }, .mask = { .dst_port = 0xffff } },
	};
	struct ibv_flow *tflow = ibv_create_flow(tso_rx, (struct ibv_flow_attr *)(void *)&tf);
	REQUIRE(tflow, "ibv_create_flow: TCP spec");
	for (int k = 0; k < 8; k++) {
		struct ibv_sge s = { .addr = (uintptr_t)(mem + 8192 + k * 2048), .length = 2048, .lkey = mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 100 + k, .sg_list = &s, .num_sge = 1 }, *b;
		ibv_post_recv(tso_rx, &w, &b);
	}
	uint8_t hdr[54] = { 2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1, 0x08, 0x00,
			    0x45, 0, 0, 40, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0, 127, 0, 0, 1, 127, 0, 0, 1 };
	hdr[36] = tport >> 8, hdr[37] = tport & 0xff;
	hdr[46] = 0x50, hdr[47] = 0x18; /* data offset 5 words; PSH, ACK */
	uint8_t *payload = mem + 32768;
	for (int i = 0; i < 3000; i++)
		payload[i] = i * 7;
	struct ibv_sge tsge = { .addr = (uintptr_t)payload, .length = 3000, .lkey = mr->lkey };
	struct ibv_send_wr twr = { .wr_id = 0x7150, .sg_list = &tsge, .num_sge = 1, .opcode = IBV_WR_TSO,
				   .send_flags = IBV_SEND_SIGNALED }, *tbad;
	twr.tso.hdr = hdr;
	twr.tso.hdr_sz = 80;
	twr.tso.mss = 1000;
	CHECK(ibv_post_send(tso_tx, &twr, &tbad) == EINVAL && tbad == &twr, "hdr_sz over max_tso_header: EINVAL");
	twr.tso.hdr_sz = sizeof(hdr);
	CHECK(ibv_post_send(tso_tx, &twr, &tbad) == 0, "ibv_post_send(IBV_WR_TSO)");
	struct ibv_wc twc = {};
	for (int i = 0; i < 100000 && ibv_poll_cq(scq, 1, &twc) == 0; i++)
		usleep(10);
	CHECK(twc.wr_id == 0x7150 && twc.status == IBV_WC_SUCCESS && twc.opcode == IBV_WC_TSO,
	      "the TSO send completes with IBV_WC_TSO");
	int segs = 0, bytes_ok = 1;
	for (int i = 0; i < 200000 && segs < 3; i++) {
		if (ibv_start_poll(rcq, &pa) != 0) {
			usleep(10);
			continue;
		}
		do {
			uint8_t *f = mem + 8192 + (rcq->wr_id - 100) * 2048;
			uint32_t len = ibv_wc_read_byte_len(rcq);
			bytes_ok &= rcq->status == IBV_WC_SUCCESS && len == 54 + 1000 &&
				    !memcmp(f + 54, payload + segs * 1000, 1000) && ((f[16] << 8) | f[17]) == 1040 &&
				    f[47] == (segs == 2 ? 0x18 : 0x10);
			segs++;
		} while (ibv_next_poll(rcq) == 0);
		ibv_end_poll(rcq);
	}
	CHECK(segs == 3 && bytes_ok, "three 1000-byte segments, lengths and PSH fixed up (%d)", segs);
	CHECK(ibv_destroy_flow(tflow) == 0 && ibv_destroy_qp(tso_rx) == 0 && ibv_destroy_qp(tso_tx) == 0,
	      "TSO QPs destroyed");

	/* RSS: four WQs, an indirection table, an RSS QP hashing IPv4 addresses and UDP ports. */
	struct ibv_cq *wcq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	struct ibv_wq *wqs[4];
	int wq_ok = 1;
	for (int i = 0; i < 4; i++) {
		struct ibv_wq_init_attr wa = { .wq_context = (void *)(uintptr_t)(i + 1), .wq_type = IBV_WQT_RQ,
					       .max_wr = 30, .max_sge = 1, .pd = pd, .cq = wcq };
		wqs[i] = ibv_create_wq(ctx, &wa);
		wq_ok &= wqs[i] && wa.max_wr >= 30 && wqs[i]->state == IBV_WQS_RESET &&
			 wqs[i]->wq_context == (void *)(uintptr_t)(i + 1);
		struct ibv_wq_attr m = { .attr_mask = IBV_WQ_ATTR_STATE, .wq_state = IBV_WQS_RDY };
		wq_ok &= wqs[i] && ibv_modify_wq(wqs[i], &m) == 0 && wqs[i]->state == IBV_WQS_RDY;
		for (int k = 0; wqs[i] && k < 16; k++) {
			struct ibv_sge s = { .addr = (uintptr_t)(mem + 65536 + (i * 16 + k) * 2048), .length = 2048,
					     .lkey = mr->lkey };
			struct ibv_recv_wr w = { .wr_id = i * 16 + k, .sg_list = &s, .num_sge = 1 }, *b;
			wq_ok &= ibv_post_wq_recv(wqs[i], &w, &b) == 0;
		}
	}
	REQUIRE(wcq && wq_ok, "ibv_create_wq, ibv_modify_wq to RDY, ibv_post_wq_recv");
	struct ibv_rwq_ind_table_init_attr ta = { .log_ind_tbl_size = 2, .ind_tbl = wqs };
	struct ibv_rwq_ind_table *table = ibv_create_rwq_ind_table(ctx, &ta);
	REQUIRE(table && table->context == ctx, "ibv_create_rwq_ind_table");
	ta.log_ind_tbl_size = 30;
	errno = 0;
	CHECK(!ibv_create_rwq_ind_table(ctx, &ta) && errno == EINVAL, "an oversized table: EINVAL");
	uint64_t fields = IBV_RX_HASH_SRC_IPV4 | IBV_RX_HASH_DST_IPV4 | IBV_RX_HASH_SRC_PORT_UDP |
			  IBV_RX_HASH_DST_PORT_UDP;
	struct ibv_qp_init_attr_ex rxa = {
		.qp_type = IBV_QPT_RAW_PACKET, .pd = pd, .rwq_ind_tbl = table,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH,
		.rx_hash_conf = { .rx_hash_function = IBV_RX_HASH_FUNC_TOEPLITZ, .rx_hash_key_len = 20,
				  .rx_hash_key = (uint8_t *)ms_key, .rx_hash_fields_mask = fields },
	};
	errno = 0;
	CHECK(!ibv_create_qp_ex(ctx, &rxa) && errno == EINVAL, "a 20-byte Toeplitz key: EINVAL");
	rxa.rx_hash_conf.rx_hash_key_len = 40;
	rxa.rx_hash_conf.rx_hash_fields_mask = IBV_RX_HASH_SRC_PORT_TCP | IBV_RX_HASH_SRC_PORT_UDP;
	errno = 0;
	CHECK(!ibv_create_qp_ex(ctx, &rxa) && errno == EINVAL, "TCP with UDP fields: EINVAL");
	rxa.rx_hash_conf.rx_hash_fields_mask = fields;
	struct ibv_qp *rss = ibv_create_qp_ex(ctx, &rxa);
	REQUIRE(rss, "RSS QP from ibv_create_qp_ex(PD | IND_TABLE | RX_HASH)");
	CHECK(ibv_destroy_rwq_ind_table(table) == EBUSY, "ibv_destroy_rwq_ind_table while used: EBUSY");
	CHECK(ibv_destroy_wq(wqs[0]) == EBUSY, "ibv_destroy_wq while in a table: EBUSY");
	uint16_t dport = 40000 + getpid() % 20000;
	struct udp_flow uf = {
		.attr = { .type = IBV_FLOW_ATTR_NORMAL, .size = sizeof(uf), .num_of_specs = 2, .port = 1 },
		.ip = { .type = IBV_FLOW_SPEC_IPV4, .size = sizeof(struct ibv_flow_spec_ipv4),
			.val = { .dst_ip = htonl(0x7f000001) }, .mask = { .dst_ip = 0xffffffff } },
		.udp = { .type = IBV_FLOW_SPEC_UDP, .size = sizeof(struct ibv_flow_spec_tcp_udp),
			 .val = { .dst_port = htons(dport) }, .mask = { .dst_port = 0xffff } },
	};
	struct ibv_flow *rflow = ibv_create_flow(rss, (struct ibv_flow_attr *)(void *)&uf);
	REQUIRE(rflow, "ibv_create_flow on the RSS QP: IPv4 and UDP specs");
	int sent = 0;
	for (int i = 0; i < 32; i++) {
		size_t l = udp_frame(frame, 1000 + i * 331, dport);
		sent += send_frame(tx, scq, mr, frame, l) == 0;
	}
	CHECK(sent == 32, "32 UDP frames sent");
	int received = 0, right_wq = 0, used[4] = {0};
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (received < 32) {
		struct ibv_wc wc;
		int k = ibv_poll_cq(wcq, 1, &wc);
		if (k == 1 && wc.status == IBV_WC_SUCCESS) {
			received++;
			uint8_t *f = mem + 65536 + wc.wr_id * 2048;
			/* source address, destination address, source port, destination port */
			uint8_t in[12];
			memcpy(in, f + 26, 8);
			memcpy(in + 8, f + 34, 4);
			int expect = toeplitz(ms_key, 40, in, 12) & 3;
			int q = -1;
			for (int i = 0; i < 4; i++)
				if (wqs[i]->wq_num == wc.qp_num)
					q = i;
			right_wq += q == expect && (int)wc.wr_id / 16 == q;
			if (q >= 0)
				used[q]++;
		}
		clock_gettime(CLOCK_MONOTONIC, &t1);
		if (t1.tv_sec - t0.tv_sec > 20)
			break;
		if (k == 0)
			usleep(100);
	}
	CHECK(received == 32 && right_wq == 32, "each frame lands in the WQ its Toeplitz hash picks (%d/%d)",
	      right_wq, received);
	CHECK(used[0] && used[1] && used[2] && used[3], "all four WQs used: %d %d %d %d", used[0], used[1],
	      used[2], used[3]);
	struct ibv_wq_attr m = { .attr_mask = IBV_WQ_ATTR_STATE | IBV_WQ_ATTR_CURR_STATE, .wq_state = IBV_WQS_ERR,
				 .curr_wq_state = IBV_WQS_RESET };
	CHECK(ibv_modify_wq(wqs[1], &m) == EINVAL, "a wrong curr_wq_state: EINVAL");
	CHECK(ibv_destroy_flow(rflow) == 0 && ibv_destroy_qp(rss) == 0 && ibv_destroy_rwq_ind_table(table) == 0,
	      "flow, RSS QP and table destroyed");
	int wq_gone = 1;
	for (int i = 0; i < 4; i++)
		wq_gone &= ibv_destroy_wq(wqs[i]) == 0;
	CHECK(wq_gone, "ibv_destroy_wq");
	CHECK(ibv_destroy_qp(tx) == 0 && ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(scq) == 0 &&
		      ibv_destroy_cq(ibv_cq_ex_to_cq(rcq)) == 0 && ibv_destroy_cq(wcq) == 0 &&
		      ibv_destroy_cq(ocq) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0,
	      "teardown");
	free(mem);
	printf("%d failed\n", failures);
	return failures != 0;
}

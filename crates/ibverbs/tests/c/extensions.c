/*
 * The newer verbs through the real <infiniband/verbs.h> against the drop-in libibverbs.so.1:
 * ATOMIC WRITE (ibv_wr_atomic_write), completion timestamps (ibv_create_cq_ex with
 * IBV_WC_EX_WITH_COMPLETION_TIMESTAMP[_WALLCLOCK], ibv_wc_read_completion_ts/_wallclock_ns,
 * ibv_query_rt_values_ex), and on-demand paging (explicit and implicit regions, faults on
 * unmapped memory turned into error completions, ibv_advise_mr and its errnos).
 * All traffic is between QPs of this process on device sv_lo.
 * Prints one "ok"/"not ok" line per check and exits non-zero if any failed.
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static int gid_index = -1;
static union ibv_gid gid;

static int connect_qp(struct ibv_qp *qp, uint32_t remote_qpn, int access)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = 1,
				 .qp_access_flags = access };
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
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		return -1;
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 4;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				     IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static uint64_t now_ns(clockid_t c)
{
	struct timespec t;
	clock_gettime(c, &t);
	return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}

static uint64_t raw_clock(void)
{
	struct ibv_values_ex v = { .comp_mask = IBV_VALUES_MASK_RAW_CLOCK };
	if (ibv_query_rt_values_ex(ctx, &v) || v.comp_mask != IBV_VALUES_MASK_RAW_CLOCK)
		return 0;
	return (uint64_t)v.raw_clock.tv_sec * 1000000000ull + v.raw_clock.tv_nsec;
}

/* Polls one completion from an extended CQ (bounded); returns 0 and fills the fields. */
static int poll_ex(struct ibv_cq_ex *cq, uint64_t *wr_id, int *status, int *opcode, uint64_t *ts, uint64_t *wall)
{
	struct ibv_poll_cq_attr pa = {};
	for (int i = 0; i < 2000000; i++) {
		int r = ibv_start_poll(cq, &pa);
		if (r == ENOENT)
			continue;
		if (r)
			return r;
		*wr_id = cq->wr_id;
		*status = cq->status;
		*opcode = ibv_wc_read_opcode(cq);
		*ts = ibv_wc_read_completion_ts(cq);
		*wall = ibv_wc_read_completion_wallclock_ns(cq);
		ibv_end_poll(cq);
		return 0;
	}
	return ETIMEDOUT;
}

static void test_device(void)
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
	struct ibv_port_attr pa;
	REQUIRE(ibv_query_port(ctx, 1, &pa) == 0, "ibv_query_port");
	for (int i = 0; i < pa.gid_tbl_len; i++) {
		union ibv_gid g;
		if (ibv_query_gid(ctx, 1, i, &g) == 0 && g.raw[10] == 0xff && g.raw[11] == 0xff &&
		    g.raw[12] == 127 && g.raw[15] == 1) {
			gid_index = i;
			gid = g;
			break;
		}
	}
	REQUIRE(gid_index >= 0, "::ffff:127.0.0.1 GID");

	struct ibv_device_attr_ex dx;
	REQUIRE(ibv_query_device_ex(ctx, NULL, &dx) == 0, "ibv_query_device_ex");
	uint64_t want = (1ull << 38) | (1ull << 39) | (1ull << 40);
	CHECK((dx.device_cap_flags_ex & want) == want, "device_cap_flags_ex has FLUSH_GLOBAL, FLUSH_PERSISTENT, ATOMIC_WRITE");
	CHECK((uint32_t)dx.device_cap_flags_ex == dx.orig_attr.device_cap_flags, "device_cap_flags_ex extends device_cap_flags");
	CHECK(dx.completion_timestamp_mask != 0 && dx.hca_core_clock == 1000000,
	      "completion_timestamp_mask %#llx, hca_core_clock %llu kHz",
	      (unsigned long long)dx.completion_timestamp_mask, (unsigned long long)dx.hca_core_clock);
	CHECK(dx.odp_caps.general_caps == (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT), "general ODP caps");
	CHECK((dx.odp_caps.per_transport_caps.rc_odp_caps & (IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV |
	       IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC)) ==
	      (IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
	       IBV_ODP_SUPPORT_ATOMIC), "RC ODP caps");
	uint32_t xrc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_SRQ_RECV | IBV_ODP_SUPPORT_WRITE | IBV_ODP_SUPPORT_READ |
		       IBV_ODP_SUPPORT_ATOMIC;
	CHECK((dx.orig_attr.device_cap_flags & IBV_DEVICE_XRC) && dx.xrc_odp_caps == xrc,
	      "XRC ODP caps: send, SRQ receives, write, read, atomics (%#x)", dx.xrc_odp_caps);

	struct ibv_values_ex v = { .comp_mask = 0 };
	CHECK(ibv_query_rt_values_ex(ctx, &v) == 0 && v.comp_mask == 0, "ibv_query_rt_values_ex with nothing asked");
	uint64_t r0 = raw_clock(), m0 = now_ns(CLOCK_MONOTONIC);
	usleep(20000);
	uint64_t r1 = raw_clock(), m1 = now_ns(CLOCK_MONOTONIC);
	CHECK(r0 && r1 > r0, "ibv_query_rt_values_ex: the raw clock advances");
	long long drift = (long long)(r1 - r0) - (long long)(m1 - m0);
	CHECK(r1 - r0 >= 20000000ull && llabs(drift) < 5000000, "raw clock ticks at 1 GHz (%llu ticks in %llu ns)",
	      (unsigned long long)(r1 - r0), (unsigned long long)(m1 - m0));
}

static void test_atomic_write_and_timestamps(void)
{
	struct ibv_cq_init_attr_ex cqa = { .cqe = 64,
		.wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
			    IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK };
	struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cqa);
	REQUIRE(cqx, "ibv_create_cq_ex with both timestamps");
	struct ibv_cq *cq = ibv_cq_ex_to_cq(cqx);
	struct ibv_qp_init_attr_ex qa = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_RDMA_WRITE,
	};
	struct ibv_qp *a = ibv_create_qp_ex(ctx, &qa);
	struct ibv_qp *b = ibv_create_qp_ex(ctx, &qa);
	REQUIRE(a && b, "ibv_create_qp_ex with IBV_QP_EX_WITH_ATOMIC_WRITE");
	int acc = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	REQUIRE(connect_qp(a, b->qp_num, acc) == 0 && connect_qp(b, a->qp_num, acc) == 0, "QPs to RTS");
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(a);

	static uint64_t mem[64];
	struct ibv_mr *mr = ibv_reg_mr(pd, mem, sizeof(mem), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	struct ibv_mr *ro = ibv_reg_mr(pd, &mem[32], 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	REQUIRE(mr && ro, "ibv_reg_mr");
	mem[3] = 0x1111111111111111ull;
	uint64_t value = 0x0123456789abcdefull;
	uint64_t wall0 = now_ns(CLOCK_REALTIME), raw0 = raw_clock();
	ibv_wr_start(qx);
	qx->wr_id = 1;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_write(qx, mr->rkey, (uintptr_t)&mem[3], &value);
	value = 0; /* the 8 bytes were taken at the call */
	CHECK(ibv_wr_complete(qx) == 0, "ibv_wr_atomic_write posted");
	uint64_t id = 0, ts = 0, wall = 0;
	int status = -1, opcode = -1;
	CHECK(poll_ex(cqx, &id, &status, &opcode, &ts, &wall) == 0 && id == 1 && status == IBV_WC_SUCCESS &&
	      opcode == IBV_WC_ATOMIC_WRITE, "ATOMIC WRITE completes (status %d, opcode %d)", status, opcode);
	CHECK(mem[3] == 0x0123456789abcdefull && mem[2] == 0 && mem[4] == 0, "the 8 bytes landed, nothing else");
	uint64_t raw1 = raw_clock(), wall1 = now_ns(CLOCK_REALTIME);
	CHECK(raw0 <= ts && ts <= raw1, "completion timestamp within the raw clock before and after");
	CHECK(wall0 <= wall && wall <= wall1, "wall-clock timestamp within the wall time before and after");

	/* Two more: timestamps do not go backwards. */
	uint64_t prev = ts;
	int monotonic = 1;
	for (int i = 0; i < 5; i++) {
		ibv_wr_start(qx);
		qx->wr_id = 10 + i;
		qx->wr_flags = IBV_SEND_SIGNALED;
		value = i;
		ibv_wr_atomic_write(qx, mr->rkey, (uintptr_t)&mem[5], &value);
		ibv_wr_complete(qx);
		if (poll_ex(cqx, &id, &status, &opcode, &ts, &wall) || status != IBV_WC_SUCCESS || ts < prev)
			monotonic = 0;
		prev = ts;
	}
	CHECK(monotonic && mem[5] == 4, "completion timestamps are monotonic");

	/* Misaligned: refused at post time. */
	ibv_wr_start(qx);
	qx->wr_id = 20;
	ibv_wr_atomic_write(qx, mr->rkey, (uintptr_t)&mem[6] + 4, &value);
	CHECK(ibv_wr_complete(qx) == EINVAL, "misaligned ATOMIC WRITE: EINVAL");
	/* A region without remote write: remote access error, memory untouched. */
	mem[32] = 7;
	ibv_wr_start(qx);
	qx->wr_id = 21;
	qx->wr_flags = IBV_SEND_SIGNALED;
	value = 99;
	ibv_wr_atomic_write(qx, ro->rkey, (uintptr_t)&mem[32], &value);
	CHECK(ibv_wr_complete(qx) == 0, "ATOMIC WRITE to a read-only region posted");
	CHECK(poll_ex(cqx, &id, &status, &opcode, &ts, &wall) == 0 && id == 21 && status == IBV_WC_REM_ACCESS_ERR &&
	      mem[32] == 7, "to a region without remote write: IBV_WC_REM_ACCESS_ERR (status %d)", status);

	/* ibv_send_wr has no fields for it. */
	struct ibv_qp *c = ibv_create_qp_ex(ctx, &qa);
	struct ibv_send_wr wr = { .wr_id = 30, .opcode = IBV_WR_ATOMIC_WRITE }, *bad;
	CHECK(c && ibv_post_send(c, &wr, &bad) == EOPNOTSUPP, "IBV_WR_ATOMIC_WRITE through ibv_post_send: EOPNOTSUPP");
	ibv_destroy_qp(c);

	struct ibv_cq_init_attr_ex tm = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_TM_INFO };
	struct ibv_cq_ex *tmcq = ibv_create_cq_ex(ctx, &tm);
	CHECK(tmcq && tmcq->read_tm_info, "tag-matching info: ibv_wc_read_tm_info is installed");
	if (tmcq)
		ibv_destroy_cq(ibv_cq_ex_to_cq(tmcq));
	struct ibv_cq_init_attr_ex vlan = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_CVLAN };
	errno = 0;
	CHECK(!ibv_create_cq_ex(ctx, &vlan) && errno == EOPNOTSUPP, "VLAN info stays EOPNOTSUPP");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_dereg_mr(ro);
}

static void test_odp(void)
{
	long page = sysconf(_SC_PAGESIZE);
	/* A page that is mapped, then unmapped, gives addresses nothing backs. */
	char *gone = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	REQUIRE(gone != MAP_FAILED, "mmap");
	munmap(gone, page);
	char *buf = aligned_alloc(page, 4 * page);
	memset(buf, 0, 4 * page);

	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *implicit = ibv_reg_mr(pd, NULL, SIZE_MAX, acc | IBV_ACCESS_ON_DEMAND);
	REQUIRE(implicit, "implicit ODP: ibv_reg_mr(pd, NULL, SIZE_MAX, ...|IBV_ACCESS_ON_DEMAND)");
	struct ibv_mr *explicit_mr = ibv_reg_mr(pd, buf, 4 * page, acc | IBV_ACCESS_ON_DEMAND);
	REQUIRE(explicit_mr, "explicit ODP region");
	errno = 0;
	CHECK(!ibv_reg_mr(pd, NULL, SIZE_MAX, acc) && errno == EINVAL, "SIZE_MAX without ODP: EINVAL");
	CHECK(!ibv_reg_mr(pd, buf, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_HUGETLB) && errno == EINVAL,
	      "IBV_ACCESS_HUGETLB without ODP: EINVAL");

	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_qp_init_attr qia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *a = ibv_create_qp(pd, &qia), *b = ibv_create_qp(pd, &qia);
	REQUIRE(a && b && connect_qp(a, b->qp_num, acc) == 0 && connect_qp(b, a->qp_num, acc) == 0, "QPs to RTS");

	/* RDMA WRITE from the explicit region into the implicit one, at an absolute address. */
	memcpy(buf, "on demand", 10);
	struct ibv_sge s = { .addr = (uintptr_t)buf, .length = 10, .lkey = explicit_mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = (uintptr_t)buf + 2 * page;
	wr.wr.rdma.rkey = implicit->rkey;
	struct ibv_wc wc;
	int n = 0;
	CHECK(ibv_post_send(a, &wr, &bad) == 0, "post RDMA WRITE into the implicit region");
	for (int i = 0; i < 2000000 && !n; i++)
		n = ibv_poll_cq(cq, 1, &wc);
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && !strcmp(buf + 2 * page, "on demand"),
	      "the WRITE landed at the absolute address (status %d)", n ? wc.status : -1);

	/* The target address is not mapped: a remote access error, not a crash. */
	wr.wr_id = 2;
	wr.wr.rdma.remote_addr = (uintptr_t)gone;
	n = 0;
	CHECK(ibv_post_send(a, &wr, &bad) == 0, "post RDMA WRITE to an unmapped address");
	for (int i = 0; i < 2000000 && !n; i++)
		n = ibv_poll_cq(cq, 1, &wc);
	CHECK(n == 1 && wc.wr_id == 2 && wc.status == IBV_WC_REM_ACCESS_ERR,
	      "WRITE to unmapped memory: IBV_WC_REM_ACCESS_ERR (status %d)", n ? wc.status : -1);
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);

	/* A local gather from unmapped memory through the implicit lkey: a local protection error. */
	a = ibv_create_qp(pd, &qia);
	b = ibv_create_qp(pd, &qia);
	REQUIRE(a && b && connect_qp(a, b->qp_num, acc) == 0 && connect_qp(b, a->qp_num, acc) == 0, "QPs to RTS");
	s.addr = (uintptr_t)gone;
	s.lkey = implicit->lkey;
	wr.wr_id = 3;
	wr.wr.rdma.remote_addr = (uintptr_t)buf;
	wr.wr.rdma.rkey = explicit_mr->rkey;
	n = 0;
	ibv_post_send(a, &wr, &bad);
	for (int i = 0; i < 2000000 && !n; i++)
		n = ibv_poll_cq(cq, 1, &wc);
	CHECK(n == 1 && wc.wr_id == 3 && wc.status == IBV_WC_LOC_PROT_ERR,
	      "gather from unmapped memory: IBV_WC_LOC_PROT_ERR (status %d)", n ? wc.status : -1);
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);

	/* ibv_advise_mr(3). */
	struct ibv_mr *plain = ibv_reg_mr(pd, buf, page, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *ro_odp = ibv_reg_mr(pd, buf, page, IBV_ACCESS_ON_DEMAND);
	struct ibv_pd *other = ibv_alloc_pd(ctx);
	struct ibv_mr *other_mr = ibv_reg_mr(other, buf, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_ON_DEMAND);
	REQUIRE(plain && ro_odp && other && other_mr, "regions for ibv_advise_mr");
	struct ibv_sge sg = { .addr = (uintptr_t)buf, .length = 2 * page, .lkey = explicit_mr->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 1) == 0, "prefetch: 0");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, IBV_ADVISE_MR_FLAG_FLUSH, &sg, 1) == 0,
	      "prefetch for write, synchronous: 0");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &sg, 1) == 0, "prefetch without fault: 0");
	CHECK(ibv_advise_mr(pd, 3, 0, &sg, 1) == EOPNOTSUPP, "unknown advice: EOPNOTSUPP");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 2, &sg, 1) == EINVAL, "unknown flag: EINVAL");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 0) == EINVAL, "no SGE: EINVAL");
	struct ibv_sge bad_key = { .addr = (uintptr_t)buf, .length = 8, .lkey = explicit_mr->lkey ^ 0x5a5a5a };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &bad_key, 1) == ENOENT, "unknown lkey: ENOENT");
	struct ibv_sge non_odp = { .addr = (uintptr_t)buf, .length = 8, .lkey = plain->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &non_odp, 1) == EINVAL, "region without ODP: EINVAL");
	struct ibv_sge outside = { .addr = (uintptr_t)buf + 3 * page, .length = 2 * page, .lkey = explicit_mr->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &outside, 1) == EFAULT, "range past the region: EFAULT");
	struct ibv_sge ro = { .addr = (uintptr_t)buf, .length = 8, .lkey = ro_odp->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &ro, 1) == 0, "read prefetch of a read-only region: 0");
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &ro, 1) == EPERM,
	      "write prefetch of a read-only region: EPERM");
	struct ibv_sge foreign = { .addr = (uintptr_t)buf, .length = 8, .lkey = other_mr->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &foreign, 1) == EPERM, "another PD's region: EPERM");
	struct ibv_sge hole = { .addr = (uintptr_t)gone, .length = 8, .lkey = implicit->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &hole, 1) == EFAULT, "unmapped memory: EFAULT");
	struct ibv_sge whole = { .addr = (uintptr_t)buf, .length = 4 * page, .lkey = implicit->lkey };
	CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &whole, 1) == 0, "prefetch through the implicit region: 0");

	ibv_dereg_mr(other_mr);
	ibv_dealloc_pd(other);
	ibv_dereg_mr(ro_odp);
	ibv_dereg_mr(plain);
	CHECK(ibv_dereg_mr(explicit_mr) == 0 && ibv_dereg_mr(implicit) == 0, "ODP regions deregister");
	free(buf);
}

int main(void)
{
	test_device();
	test_atomic_write_and_timestamps();
	test_odp();
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("%d failed\n", failures);
	return failures ? 1 : 0;
}

/* rdma_cma.h calls in one process over softverbs' librdmacm.so.1 and libibverbs.so.1: devices,
 * options, QP attributes, SRQs, a rejection with private data both ways, ECE, the event names,
 * and the errno convention. Prints "ok" and exits 0 when every check holds; otherwise the exit status
 * names the failed check. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

static int expect(struct rdma_event_channel *ch, enum rdma_cm_event_type type,
                  struct rdma_cm_event **out)
{
    if (rdma_get_cm_event(ch, out))
        return -1;
    if ((*out)->event != type) {
        fprintf(stderr, "got %s, wanted %s\n", rdma_event_str((*out)->event),
                rdma_event_str(type));
        return -1;
    }
    return 0;
}

int main(void)
{
    struct rdma_event_channel *ch = rdma_create_event_channel();
    struct rdma_cm_id *listen_id, *client, *child;
    struct rdma_cm_event *ev;
    struct sockaddr_in sin = { .sin_family = AF_INET };
    int n = 0;

    if (!ch || ch->fd < 0) return 1;
    struct ibv_context **devs = rdma_get_devices(&n);
    if (!devs || n < 1 || !devs[0] || devs[n]) return 2;
    rdma_free_devices(devs);

    if (rdma_create_id(ch, &listen_id, (void *)0x1234, RDMA_PS_TCP)) return 3;
    errno = 0;
    if (rdma_create_id(ch, &client, NULL, 0x7777) != -1 || errno != EINVAL) return 4;
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (rdma_bind_addr(listen_id, (struct sockaddr *)&sin)) return 5;
    /* A loopback address binds like the wildcard (as the kernel's rdma_cm): no device yet. */
    if (listen_id->verbs) return 6;
    if (rdma_listen(listen_id, 4) || rdma_get_src_port(listen_id) == 0) return 7;

    if (rdma_create_id(ch, &client, NULL, RDMA_PS_TCP)) return 8;
    uint8_t tos = 32;
    if (rdma_set_option(client, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, sizeof tos)) return 9;
    errno = 0;
    if (rdma_set_option(client, RDMA_OPTION_ID, 99, &tos, sizeof tos) != -1 || errno != EINVAL)
        return 10;
    sin.sin_port = rdma_get_src_port(listen_id);
    if (rdma_resolve_addr(client, NULL, (struct sockaddr *)&sin, 2000)) return 11;
    if (expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, &ev) || ev->id != client) return 12;
    rdma_ack_cm_event(ev);
    if (rdma_resolve_route(client, 2000)) return 13;
    if (expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, &ev)) return 14;
    rdma_ack_cm_event(ev);
    if (!client->verbs) return 15;
    if (rdma_get_dst_port(client) != sin.sin_port) return 16;
    if (((struct sockaddr_in *)rdma_get_peer_addr(client))->sin_addr.s_addr != sin.sin_addr.s_addr)
        return 17;

    /* A non-blocking channel with nothing pending: -1 and EAGAIN, and its fd is not readable. */
    int fl = fcntl(ch->fd, F_GETFL);
    if (fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK)) return 36;
    errno = 0;
    if (rdma_get_cm_event(ch, &ev) != -1 || errno != EAGAIN) return 37;
    struct pollfd pfd = { .fd = ch->fd, .events = POLLIN };
    if (poll(&pfd, 1, 0) != 0) return 38;
    if (fcntl(ch->fd, F_SETFL, fl)) return 39;

    struct ibv_qp_attr qa = { .qp_state = IBV_QPS_INIT };
    int mask = 0;
    if (rdma_init_qp_attr(client, &qa, &mask)) return 18;
    if (!(mask & IBV_QP_STATE) || !(mask & IBV_QP_ACCESS_FLAGS) || qa.port_num != 1) return 19;

    /* An SRQ on the id (default PD), destroyed again. */
    struct ibv_srq_init_attr sa = { .attr = { .max_wr = 8, .max_sge = 1 } };
    if (rdma_create_srq(client, NULL, &sa) || !client->srq || client->srq->pd != client->pd)
        return 34;
    rdma_destroy_srq(client);
    if (client->srq) return 35;

    /* rdma_create_srq_ex with an empty mask: a basic SRQ in the id's PD, the mask filled in. */
    struct ibv_srq_init_attr_ex sx = { .attr = { .max_wr = 8, .max_sge = 1 } };
    if (rdma_create_srq_ex(client, &sx) || !client->srq || client->srq->pd != client->pd)
        return 60;
    if (!(sx.comp_mask & IBV_SRQ_INIT_ATTR_TYPE) || sx.srq_type != IBV_SRQT_BASIC ||
        !(sx.comp_mask & IBV_SRQ_INIT_ATTR_PD) || sx.pd != client->pd)
        return 61;
    /* A second SRQ on the same id is refused. */
    errno = 0;
    if (rdma_create_srq_ex(client, &sx) != -1 || errno != EINVAL) return 62;
    rdma_destroy_srq(client);
    /* An XRC SRQ with only the type given: the library supplies a domain and a receive CQ. */
    struct ibv_srq_init_attr_ex xx = { .attr = { .max_wr = 8, .max_sge = 1 },
                                       .comp_mask = IBV_SRQ_INIT_ATTR_TYPE,
                                       .srq_type = IBV_SRQT_XRC };
    if (rdma_create_srq_ex(client, &xx) || !client->srq || !xx.xrcd || !xx.cq ||
        xx.cq != client->recv_cq || !client->recv_cq_channel)
        return 63;
    uint32_t srqn = 0;
    if (ibv_get_srq_num(client->srq, &srqn) || srqn == 0) return 64;
    rdma_destroy_srq(client);
    if (client->srq || client->recv_cq || client->recv_cq_channel) return 65;

    /* A QP from ibv_qp_init_attr_ex with no PD and no CQs: the id gets the device's PD and CQs
     * with completion channels, and the QP is in INIT. */
    struct ibv_qp_init_attr_ex ax = { .qp_type = IBV_QPT_RC,
                                      .cap = { .max_send_wr = 4, .max_recv_wr = 4,
                                               .max_send_sge = 1, .max_recv_sge = 1 } };
    if (rdma_create_qp_ex(client, &ax) || !client->qp || !client->pd || !client->send_cq ||
        !client->recv_cq || !client->send_cq_channel || client->qp->pd != client->pd)
        return 30;
    struct ibv_qp_attr qattr;
    struct ibv_qp_init_attr qinit;
    if (ibv_query_qp(client->qp, &qattr, IBV_QP_STATE, &qinit) || qattr.qp_state != IBV_QPS_INIT)
        return 31;

    const char hello[] = "hello, listener";
    struct rdma_conn_param cp = { .private_data = hello, .private_data_len = sizeof hello,
                                  .responder_resources = 1, .initiator_depth = 1,
                                  .retry_count = 7, .qp_num = 0x123 };
    if (rdma_connect(client, &cp)) return 20;
    /* The channel's fd becomes readable once the request is pending. */
    if (poll(&pfd, 1, 5000) != 1 || !(pfd.revents & POLLIN)) return 40;
    if (expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev)) return 21;
    child = ev->id;
    if (ev->listen_id != listen_id || child == listen_id || child->context != (void *)0x1234)
        return 22;
    if (ev->param.conn.private_data_len < sizeof hello ||
        memcmp(ev->param.conn.private_data, hello, sizeof hello))
        return 23;
    if (child->verbs != client->verbs || rdma_get_src_port(child) != sin.sin_port) return 24;
    rdma_ack_cm_event(ev);

    const char no[] = "not today";
    if (rdma_reject(child, no, sizeof no)) return 25;
    if (expect(ch, RDMA_CM_EVENT_REJECTED, &ev) || ev->id != client) return 26;
    if (ev->status != 28 || ev->param.conn.private_data_len < sizeof no ||
        memcmp(ev->param.conn.private_data, no, sizeof no))
        return 27;
    rdma_ack_cm_event(ev);

    /* The rejection moved the client's QP to ERR, as librdmacm does. */
    if (ibv_query_qp(client->qp, &qattr, IBV_QP_STATE, &qinit) || qattr.qp_state != IBV_QPS_ERR)
        return 32;
    rdma_destroy_qp(client);
    if (client->qp) return 33;

    /* ECE on an id whose QP the application keeps (none here: qp_num in the parameters). */
    struct rdma_cm_id *ece_client, *ece_child;
    struct ibv_ece ece = { .vendor_id = 0x2c9, .options = 0x77 }, got;
    if (rdma_create_id(ch, &ece_client, NULL, RDMA_PS_TCP)) return 70;
    if (rdma_resolve_addr(ece_client, NULL, (struct sockaddr *)&sin, 2000)) return 71;
    if (expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED, &ev)) return 72;
    rdma_ack_cm_event(ev);
    if (rdma_resolve_route(ece_client, 2000)) return 73;
    if (expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, &ev)) return 74;
    rdma_ack_cm_event(ev);
    struct ibv_ece zero = { 0 };
    errno = 0;
    if (rdma_set_local_ece(ece_client, &zero) != -1 || errno != EINVAL) return 75;
    if (rdma_set_local_ece(ece_client, &ece)) return 76;
    struct rdma_conn_param ecp = { .qp_num = 0x456, .retry_count = 7 };
    if (rdma_connect(ece_client, &ecp)) return 77;
    if (expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev)) return 78;
    ece_child = ev->id;
    rdma_ack_cm_event(ev);
    memset(&got, 0xff, sizeof got);
    if (rdma_get_remote_ece(ece_child, &got) || got.vendor_id != ece.vendor_id ||
        got.options != ece.options || got.comp_mask)
        return 79;
    if (rdma_reject_ece(ece_child, NULL, 0)) return 80;
    if (expect(ch, RDMA_CM_EVENT_REJECTED, &ev) || ev->id != ece_client || ev->status != 35)
        return 81;
    rdma_ack_cm_event(ev);
    if (rdma_destroy_id(ece_child) || rdma_destroy_id(ece_client)) return 82;

    if (rdma_destroy_id(child) || rdma_destroy_id(client) || rdma_destroy_id(listen_id)) return 28;
    rdma_destroy_event_channel(ch);
    if (strcmp(rdma_event_str(RDMA_CM_EVENT_TIMEWAIT_EXIT), "RDMA_CM_EVENT_TIMEWAIT_EXIT"))
        return 29;
    printf("ok\n");
    return 0;
}

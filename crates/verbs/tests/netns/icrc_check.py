#!/usr/bin/env python3
"""Independent ICRC check of RoCEv2 packets in a pcap file, with zlib's CRC-32.

Implements the ICRC as the RoCEv2 annex defines it, separately from the project's Rust code:
8 bytes of 0xFF, then the IP and UDP headers and the BTH with their variant fields set to ones,
then the rest of the packet up to the ICRC. Prints "checked N id_nonzero K mismatched M", K
being the IPv4 packets whose ID (which the ICRC covers) is not 0.
"""
import struct
import sys
import zlib


def packets(path):
    with open(path, "rb") as f:
        header = f.read(24)
        magic = struct.unpack("<I", header[:4])[0]
        endian = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
        linktype = struct.unpack(endian + "I", header[20:24])[0]
        while True:
            rec = f.read(16)
            if len(rec) < 16:
                return
            incl = struct.unpack(endian + "IIII", rec)[2]
            yield linktype, f.read(incl)


def icrc_ok(ip):
    version = ip[0] >> 4
    if version == 4:
        ihl = (ip[0] & 15) * 4
        if ip[9] != 17:
            return None
        hdr = bytearray(ip[:ihl])
        hdr[1] = 0xFF  # TOS
        hdr[8] = 0xFF  # TTL
        hdr[10:12] = b"\xff\xff"  # header checksum
        udp = bytearray(ip[ihl:ihl + 8])
        rest = ip[ihl + 8:]
    elif version == 6:
        if ip[6] != 17:
            return None
        hdr = bytearray(ip[:40])
        hdr[0:4] = bytes([0x6F, 0xFF, 0xFF, 0xFF])  # traffic class and flow label
        hdr[7] = 0xFF  # hop limit
        udp = bytearray(ip[40:48])
        rest = ip[48:]
    else:
        return None
    dport = struct.unpack(">H", udp[2:4])[0]
    if not 4791 <= dport < 4791 + 256 or len(rest) < 16:
        return None
    udp[6:8] = b"\xff\xff"  # UDP checksum
    bth = bytearray(rest[:12])
    bth[4] = 0xFF  # FECN, BECN, reserved
    data = b"\xff" * 8 + bytes(hdr) + bytes(udp) + bytes(bth) + bytes(rest[12:-4])
    crc = zlib.crc32(data) & 0xFFFFFFFF
    return struct.pack("<I", crc) == bytes(rest[-4:])


def main():
    checked = mismatched = id_nonzero = 0
    for linktype, frame in packets(sys.argv[1]):
        if linktype == 1:  # Ethernet
            ethertype = struct.unpack(">H", frame[12:14])[0]
            ip = frame[14:] if ethertype in (0x0800, 0x86DD) else None
        elif linktype == 113:  # Linux cooked capture
            ip = frame[16:]
        else:
            ip = frame
        if not ip:
            continue
        ok = icrc_ok(ip)
        if ok is None:
            continue
        checked += 1
        mismatched += 0 if ok else 1
        id_nonzero += 1 if ip[0] >> 4 == 4 and ip[4:6] != b"\x00\x00" else 0
    print(f"checked {checked} id_nonzero {id_nonzero} mismatched {mismatched}")


if __name__ == "__main__":
    main()

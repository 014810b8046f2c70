//! Hand-made Ethernet frames, for `BPF_PROG_TEST_RUN`.

use std::net::IpAddr;

const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_ARP: u16 = 0x0806;
const IPPROTO_UDP: u8 = 17;

/// An Ethernet frame carrying a UDP datagram of `payload` zero bytes from
/// `src` to `dst` (port 40000 to 50000). `None` if the families differ.
pub fn udp_frame(src: IpAddr, dst: IpAddr, payload: usize) -> Option<Vec<u8>> {
    let udp_len = 8 + payload;
    let mut frame = Vec::with_capacity(14 + 40 + udp_len);
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            ethernet(&mut frame, ETH_P_IP);
            let total = u16::try_from(20 + udp_len).ok()?;
            let mut header = [0u8; 20];
            header[0] = 0x45; // version 4, 5 words
            header[2..4].copy_from_slice(&total.to_be_bytes());
            header[8] = 64; // TTL
            header[9] = IPPROTO_UDP;
            header[12..16].copy_from_slice(&src.octets());
            header[16..20].copy_from_slice(&dst.octets());
            let checksum = ipv4_checksum(&header);
            header[10..12].copy_from_slice(&checksum.to_be_bytes());
            frame.extend_from_slice(&header);
        }
        (IpAddr::V6(src), IpAddr::V6(dst)) => {
            ethernet(&mut frame, ETH_P_IPV6);
            let mut header = [0u8; 40];
            header[0] = 0x60; // version 6
            header[4..6].copy_from_slice(&u16::try_from(udp_len).ok()?.to_be_bytes());
            header[6] = IPPROTO_UDP;
            header[7] = 64; // hop limit
            header[8..24].copy_from_slice(&src.octets());
            header[24..40].copy_from_slice(&dst.octets());
            frame.extend_from_slice(&header);
        }
        _ => return None,
    }
    frame.extend_from_slice(&40_000u16.to_be_bytes());
    frame.extend_from_slice(&50_000u16.to_be_bytes());
    frame.extend_from_slice(&u16::try_from(udp_len).ok()?.to_be_bytes());
    frame.extend_from_slice(&[0, 0]); // no UDP checksum
    frame.resize(frame.len() + payload, 0);
    Some(frame)
}

/// An Ethernet frame carrying an ARP request: not IP.
pub fn arp_frame() -> Vec<u8> {
    let mut frame = Vec::with_capacity(42);
    ethernet(&mut frame, ETH_P_ARP);
    frame.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&SRC_MAC);
    frame.extend_from_slice(&[198, 18, 1, 2]);
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&[198, 18, 1, 1]);
    frame
}

fn ethernet(frame: &mut Vec<u8>, ethertype: u16) {
    frame.extend_from_slice(&DST_MAC);
    frame.extend_from_slice(&SRC_MAC);
    frame.extend_from_slice(&ethertype.to_be_bytes());
}

fn ipv4_checksum(header: &[u8; 20]) -> u16 {
    let mut sum: u32 = header
        .chunks_exact(2)
        .map(|word| u32::from(u16::from_be_bytes([word[0], word[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn ipv4_frames_have_a_valid_header_checksum() {
        let frame = udp_frame(
            Ipv4Addr::new(198, 18, 1, 2).into(),
            Ipv4Addr::new(198, 18, 2, 2).into(),
            100,
        );
        let frame = frame.unwrap_or_default();
        assert_eq!(frame.len(), 14 + 20 + 8 + 100);
        let mut header = [0u8; 20];
        header.copy_from_slice(&frame[14..34]);
        // A header with its checksum in place sums to 0xffff.
        assert_eq!(ipv4_checksum(&header), 0);
    }

    #[test]
    fn ipv6_frames_carry_the_payload_length() {
        let frame = udp_frame(Ipv6Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into(), 10)
            .unwrap_or_default();
        assert_eq!(frame.len(), 14 + 40 + 8 + 10);
        assert_eq!(&frame[18..20], &18u16.to_be_bytes());
    }

    #[test]
    fn mixed_families_make_no_frame() {
        assert_eq!(
            udp_frame(Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into(), 1),
            None
        );
    }
}

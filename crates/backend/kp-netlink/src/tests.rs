use super::*;

/// An nfnetlink message with a string, a big-endian integer and a nest, byte for byte.
#[test]
fn a_message_is_written_with_its_lengths_and_padding() {
    let mut w = Writer::new();
    let m = w.begin_nfnl(0x0a00, NLM_F_REQUEST | NLM_F_CREATE, 7, 2, 0x0a);
    w.put_str(1, "ab");
    let nest = w.nest(3);
    w.put_u32(1, 0x0102_0304);
    w.nest_end(nest);
    w.end(m);
    let want: Vec<u8> = [
        &40u32.to_ne_bytes()[..],
        &0x0a00u16.to_ne_bytes(),
        &0x0401u16.to_ne_bytes(),
        &7u32.to_ne_bytes(),
        &0u32.to_ne_bytes(),
        &[2, 0, 0, 0x0a],
        // "ab\0" padded to 4.
        &7u16.to_ne_bytes(),
        &1u16.to_ne_bytes(),
        b"ab\0\0",
        // The nest: its header and one u32 attribute.
        &12u16.to_ne_bytes(),
        &(3 | NLA_F_NESTED).to_ne_bytes(),
        &8u16.to_ne_bytes(),
        &1u16.to_ne_bytes(),
        &[1, 2, 3, 4],
    ]
    .concat();
    assert_eq!(w.bytes(), &want[..]);
}

#[test]
fn a_datagram_reads_back_as_its_messages_and_attributes() {
    let mut w = Writer::new();
    let first = w.begin(NLMSG_ERROR, 0, 5);
    w.buffer_mut().extend_from_slice(&(-2i32).to_ne_bytes());
    w.end(first);
    let second = w.begin_nfnl(0x0a03, NLM_F_ECHO, 6, 10, 0);
    w.put_str(3, "KUBE-SVC");
    let nest = w.nest(4);
    w.put(1, &[9]);
    w.nest_end(nest);
    w.end(second);
    let read: Vec<Message<'_>> = messages(w.bytes())
        .collect::<Result<_, _>>()
        .expect("framed");
    assert_eq!(read.len(), 2);
    assert_eq!((read[0].seq, read[0].error_code()), (5, Some(-2)));
    assert_eq!(
        (read[1].kind, read[1].flags, read[1].seq),
        (0x0a03, NLM_F_ECHO, 6)
    );
    assert_eq!(read[1].error_code(), None, "not an NLMSG_ERROR");
    assert_eq!(read[1].bytes.len(), NLMSG_HDRLEN + read[1].payload.len());
    assert_eq!(&read[1].bytes[NLMSG_HDRLEN..], read[1].payload);
    let attrs: Vec<(u16, &[u8])> = attributes(&read[1].payload[NFGENMSG_LEN..]).collect();
    assert_eq!(attrs[0], (3, &b"KUBE-SVC\0"[..]));
    // The nested flag is not part of the type; the nest's value holds its attributes.
    assert_eq!(attrs[1].0, 4);
    assert_eq!(attributes(attrs[1].1).collect::<Vec<_>>(), [(1, &[9][..])]);
}

#[test]
fn broken_framing_ends_with_an_error() {
    let mut w = Writer::new();
    let m = w.begin(0x0a00, 0, 1);
    w.put_u32(1, 1);
    w.end(m);
    let mut short = w.bytes().to_vec();
    short.truncate(20);
    let read: Vec<_> = messages(&short).collect();
    assert_eq!(read, [Err(FrameError::Message { len: 24, left: 20 })]);
    // An attribute longer than its body: what came before it is kept by `attributes`.
    let body = [8, 0, 1, 0, 1, 2, 3, 4, 12, 0, 2, 0, 0, 0];
    assert_eq!(attributes(&body).count(), 1);
    let strict: Vec<_> = try_attributes(&body).collect();
    assert_eq!(strict[1], Err(FrameError::Attribute { len: 12, left: 6 }));
    // ipset's byte-order flag is not part of the type either.
    let flagged = [
        &8u16.to_ne_bytes()[..],
        &(6 | NLA_F_NET_BYTEORDER).to_ne_bytes(),
        &[0, 0, 0, 4],
    ]
    .concat();
    assert_eq!(attributes(&flagged).next().map(|(kind, _)| kind), Some(6));
}

//! Splitting a byte stream into AMQP frames.
//!
//! The frame header is checked against the negotiated frame-max *before* the payload is
//! buffered, so a hostile peer cannot make the broker allocate more than frame-max per
//! connection. Payloads are `Bytes` slices of the read buffer: a body frame becomes a message
//! body without a copy.

use bytes::{Buf, Bytes, BytesMut};
use thiserror::Error;

/// Frame type octet of a method frame.
pub const FRAME_METHOD: u8 = 1;
/// Frame type octet of a content header frame.
pub const FRAME_HEADER: u8 = 2;
/// Frame type octet of a content body frame.
pub const FRAME_BODY: u8 = 3;
/// Frame type octet of a heartbeat frame.
pub const FRAME_HEARTBEAT: u8 = 8;
/// The octet that ends every frame.
pub const FRAME_END: u8 = 0xCE;
/// Bytes of framing around a payload: type (1), channel (2), size (4) and frame-end (1).
pub const FRAME_OVERHEAD: usize = 8;
/// The smallest frame-max a peer may negotiate (spec: frame-min-size).
pub const FRAME_MIN_SIZE: u32 = 4096;
/// The protocol header a 0-9-1 client sends and the broker answers with on a mismatch.
pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";

/// A frame as it came off the wire, payload not yet decoded.
#[derive(Debug, Clone)]
pub struct RawFrame {
    /// Frame type octet (`FRAME_METHOD`, ...).
    pub kind: u8,
    /// Channel number.
    pub channel: u16,
    /// The payload, a zero-copy slice of the read buffer.
    pub payload: Bytes,
}

/// Why a byte stream is not a valid frame sequence; each is a connection-level frame-error.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    /// The header announces a frame larger than the negotiated frame-max.
    #[error("frame of {size} bytes exceeds frame-max {max}")]
    TooLarge {
        /// Total frame size announced.
        size: u64,
        /// Negotiated frame-max.
        max: u32,
    },
    /// The octet after the payload is not 0xCE.
    #[error("frame-end octet is {0:#04x}, expected 0xce")]
    BadFrameEnd(u8),
    /// An unknown frame type octet.
    #[error("unknown frame type {0}")]
    UnknownType(u8),
}

/// Takes one complete frame off the front of `buf`, or returns `Ok(None)` when more bytes are
/// needed. `frame_max` bounds the whole frame (header, payload and frame-end), as the spec
/// defines it; 0 means "no limit" only in the sense the spec gives it, so callers pass the
/// broker's own ceiling instead.
pub fn split_frame(buf: &mut BytesMut, frame_max: u32) -> Result<Option<RawFrame>, FrameError> {
    if buf.len() < 7 {
        return Ok(None);
    }
    let kind = buf[0];
    if !matches!(
        kind,
        FRAME_METHOD | FRAME_HEADER | FRAME_BODY | FRAME_HEARTBEAT
    ) {
        return Err(FrameError::UnknownType(kind));
    }
    let size = u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as usize;
    let total = size as u64 + FRAME_OVERHEAD as u64;
    if total > u64::from(frame_max) {
        return Err(FrameError::TooLarge {
            size: total,
            max: frame_max,
        });
    }
    let total = total as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let end = buf[total - 1];
    if end != FRAME_END {
        return Err(FrameError::BadFrameEnd(end));
    }
    let channel = u16::from_be_bytes([buf[1], buf[2]]);
    let mut frame = buf.split_to(total);
    frame.advance(7);
    frame.truncate(size);
    Ok(Some(RawFrame {
        kind,
        channel,
        payload: frame.freeze(),
    }))
}

/// Class and method ids at the start of a method payload, read without decoding the rest, so
/// that an unknown method can be told apart from a malformed one.
pub fn method_ids(payload: &[u8]) -> Option<(u16, u16)> {
    if payload.len() < 4 {
        return None;
    }
    Some((
        u16::from_be_bytes([payload[0], payload[1]]),
        u16::from_be_bytes([payload[2], payload[3]]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, channel: u16, payload: &[u8], end: u8) -> Vec<u8> {
        let mut v = vec![kind];
        v.extend_from_slice(&channel.to_be_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        v.extend_from_slice(payload);
        v.push(end);
        v
    }

    #[test]
    fn splits_back_to_back_frames_and_waits_for_partial_ones() {
        let mut bytes = frame(FRAME_BODY, 3, b"hello", FRAME_END);
        bytes.extend(frame(FRAME_HEARTBEAT, 0, b"", FRAME_END));
        let partial = frame(FRAME_METHOD, 1, b"abcdef", FRAME_END);
        bytes.extend_from_slice(&partial[..5]);
        let mut buf = BytesMut::from(&bytes[..]);
        let first = split_frame(&mut buf, 131072).unwrap().unwrap();
        assert_eq!(
            (first.kind, first.channel, &first.payload[..]),
            (FRAME_BODY, 3, &b"hello"[..])
        );
        let second = split_frame(&mut buf, 131072).unwrap().unwrap();
        assert_eq!(second.kind, FRAME_HEARTBEAT);
        assert!(split_frame(&mut buf, 131072).unwrap().is_none());
        buf.extend_from_slice(&partial[5..]);
        let third = split_frame(&mut buf, 131072).unwrap().unwrap();
        assert_eq!(&third.payload[..], b"abcdef");
        assert!(buf.is_empty());
    }

    #[test]
    fn rejects_a_frame_over_frame_max_from_its_header_alone() {
        let mut buf = BytesMut::from(&[FRAME_BODY, 0, 1, 0x10, 0, 0, 0][..]);
        assert_eq!(
            split_frame(&mut buf, 4096).unwrap_err(),
            FrameError::TooLarge {
                size: 0x1000_0000 + 8,
                max: 4096
            }
        );
    }

    #[test]
    fn rejects_a_bad_frame_end_and_an_unknown_type() {
        let mut buf = BytesMut::from(&frame(FRAME_BODY, 1, b"x", 0x00)[..]);
        assert_eq!(
            split_frame(&mut buf, 4096).unwrap_err(),
            FrameError::BadFrameEnd(0)
        );
        let mut buf = BytesMut::from(&frame(9, 1, b"x", FRAME_END)[..]);
        assert_eq!(
            split_frame(&mut buf, 4096).unwrap_err(),
            FrameError::UnknownType(9)
        );
    }
}

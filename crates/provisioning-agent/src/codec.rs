//! The one line codec of the controller–agent protocols: bounded,
//! cancel-safe JSON lines.
//!
//! Every message on every channel (see [`crate::wire`]) is one line of JSON.
//! [`JsonLinesCodec`] frames such lines on top of `tokio-util`'s
//! [`LinesCodec`] with a length bound, and (de)serialises them with serde.
//! [`MessageReader`] wraps it for the common case of reading one typed
//! message after another from an [`AsyncRead`]:
//!
//! ```no_run
//! # async fn demo(stream: tokio::net::TcpStream) -> Result<(), provisioning_agent::codec::CodecError> {
//! use provisioning_agent::codec::{MessageReader, write_message};
//! use provisioning_agent::wire::{ControlReply, ControlRequest};
//!
//! let (read, mut write) = stream.into_split();
//! write_message(&mut write, &ControlRequest::Join).await?;
//! let mut replies = MessageReader::<ControlReply, _>::new(read);
//! while let Some(reply) = replies.next().await? {
//!     println!("{reply:?}");
//! }
//! # Ok(()) }
//! ```
//!
//! **Cancel safety.** [`MessageReader::next`] keeps a partly received line in
//! the reader, not in the future: dropping the future (a `select!` branch
//! that lost) loses nothing, and the next call picks the line up where it
//! was. A reader may therefore be polled in a loop of `select!`s. Writing
//! ([`write_message`]) is not cancel-safe: a dropped write may leave half a
//! line on the connection, so callers write from one place and never race a
//! write against anything but the connection's end.
//!
//! **Bounds.** A line is at most [`LINE_BYTES_MAX`] bytes including its
//! newline (or a bound of the caller's, [`JsonLinesCodec::with_max_line_bytes`]).
//! A longer line, a line that is not a message, and a stream that ends in
//! the middle of a line are errors; after an error a reader yields nothing
//! more, and callers drop the connection.
//!
//! [`TextLinesCodec`] is the same framing for free text a peer writes for
//! people (an agent's log on its standard error): it never fails on content,
//! it cuts long lines into bounded pieces instead.

use std::marker::PhantomData;

use bytes::{BufMut, BytesMut};
use futures_util::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder, FramedRead, LinesCodec, LinesCodecError};

/// The longest accepted line, newline included, unless a codec is given
/// another bound.
pub const LINE_BYTES_MAX: usize = 64 * 1024;

/// A line could not be read or written.
#[derive(Debug, Error)]
pub enum CodecError {
    /// The connection failed.
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
    /// A line exceeded the bound ([`LINE_BYTES_MAX`] unless set otherwise).
    #[error("line longer than {0} bytes")]
    LineTooLong(usize),
    /// The connection ended in the middle of a line.
    #[error("connection closed in the middle of a line")]
    Truncated,
    /// A line was not UTF-8, so not JSON.
    #[error("malformed message: the line is not UTF-8")]
    NotUtf8,
    /// A line was not a valid message.
    #[error("malformed message: {0}")]
    Malformed(#[source] serde_json::Error),
}

/// Frames JSON messages of type `T` as lines: a [`Decoder`] of `T` and an
/// [`Encoder`] of anything serialisable, for `tokio-util`'s `FramedRead` and
/// `FramedWrite`.
#[derive(Debug)]
pub struct JsonLinesCodec<T> {
    lines: LinesCodec,
    /// The bound, newline included.
    max_line_bytes: usize,
    message: PhantomData<fn() -> T>,
}

impl<T> JsonLinesCodec<T> {
    /// A codec bounded by [`LINE_BYTES_MAX`].
    pub fn new() -> Self {
        Self::with_max_line_bytes(LINE_BYTES_MAX)
    }

    /// A codec whose lines are at most `max_line_bytes` long, newline
    /// included (at least 2: one byte and the newline).
    pub fn with_max_line_bytes(max_line_bytes: usize) -> Self {
        let max_line_bytes = max_line_bytes.max(2);
        JsonLinesCodec {
            // `LinesCodec` bounds a line without its newline.
            lines: LinesCodec::new_with_max_length(max_line_bytes - 1),
            max_line_bytes,
            message: PhantomData,
        }
    }

    /// The bound, newline included.
    pub fn max_line_bytes(&self) -> usize {
        self.max_line_bytes
    }

    fn lines_error(&self, error: LinesCodecError) -> CodecError {
        match error {
            LinesCodecError::MaxLineLengthExceeded => CodecError::LineTooLong(self.max_line_bytes),
            // `LinesCodec` does no I/O while decoding: its only I/O error
            // is a line that is not UTF-8.
            LinesCodecError::Io(_) => CodecError::NotUtf8,
        }
    }
}

impl<T> Default for JsonLinesCodec<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: DeserializeOwned> Decoder for JsonLinesCodec<T> {
    type Item = T;
    type Error = CodecError;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<T>, CodecError> {
        match self.lines.decode(buf) {
            Ok(Some(line)) => serde_json::from_str(&line)
                .map(Some)
                .map_err(CodecError::Malformed),
            Ok(None) => Ok(None),
            Err(error) => Err(self.lines_error(error)),
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<T>, CodecError> {
        // Unlike `LinesCodec`, a last line without its newline is not a
        // message: the peer ended in the middle of it.
        match self.decode(buf)? {
            Some(message) => Ok(Some(message)),
            None if buf.is_empty() => Ok(None),
            None => {
                buf.clear();
                Err(CodecError::Truncated)
            }
        }
    }
}

impl<T, M: Serialize> Encoder<M> for JsonLinesCodec<T> {
    type Error = CodecError;

    fn encode(&mut self, message: M, dst: &mut BytesMut) -> Result<(), CodecError> {
        let line = encode_line(&message, self.max_line_bytes)?;
        dst.reserve(line.len());
        dst.put_slice(&line);
        Ok(())
    }
}

/// Encodes `message` as one line, newline included, of at most
/// `max_line_bytes`.
fn encode_line<M: Serialize>(message: &M, max_line_bytes: usize) -> Result<Vec<u8>, CodecError> {
    let mut line = serde_json::to_vec(message).map_err(CodecError::Malformed)?;
    line.push(b'\n');
    if line.len() > max_line_bytes {
        return Err(CodecError::LineTooLong(max_line_bytes));
    }
    Ok(line)
}

/// Encodes `message` as one line, newline included.
///
/// # Errors
/// [`CodecError::Malformed`] when `message` does not serialise,
/// [`CodecError::LineTooLong`] when the line would exceed [`LINE_BYTES_MAX`].
pub fn encode_message<M: Serialize>(message: &M) -> Result<Vec<u8>, CodecError> {
    encode_line(message, LINE_BYTES_MAX)
}

/// Writes `message` as one line and flushes. Not cancel-safe (see the
/// module documentation).
///
/// # Errors
/// As [`encode_message`], plus [`CodecError::Io`].
pub async fn write_message<M, W>(writer: &mut W, message: &M) -> Result<(), CodecError>
where
    M: Serialize,
    W: AsyncWrite + Unpin,
{
    let line = encode_message(message)?;
    writer.write_all(&line).await?;
    writer.flush().await?;
    Ok(())
}

/// Reads JSON messages of type `T`, one a line, from `R`.
#[derive(Debug)]
pub struct MessageReader<T, R> {
    framed: FramedRead<R, JsonLinesCodec<T>>,
}

impl<T: DeserializeOwned, R: AsyncRead + Unpin> MessageReader<T, R> {
    /// A reader bounded by [`LINE_BYTES_MAX`].
    pub fn new(read: R) -> Self {
        Self::with_codec(read, JsonLinesCodec::new())
    }

    /// A reader with a codec of the caller's (another line bound).
    pub fn with_codec(read: R, codec: JsonLinesCodec<T>) -> Self {
        MessageReader {
            framed: FramedRead::new(read, codec),
        }
    }

    /// The next message; `Ok(None)` is a clean end of the stream (and so is
    /// every call after an error). Cancel-safe.
    ///
    /// # Errors
    /// [`CodecError`] for I/O errors, oversized or truncated lines, and
    /// lines that do not parse as `T`.
    pub async fn next(&mut self) -> Result<Option<T>, CodecError> {
        self.framed.next().await.transpose()
    }

    /// Whether bytes past the last message were received and not read yet.
    pub fn has_buffered(&self) -> bool {
        !self.framed.read_buffer().is_empty()
    }

    /// The same reader, reading messages of another type from here on (a
    /// protocol whose first message differs from the rest). Bytes already
    /// received are kept.
    pub fn retyped<U: DeserializeOwned>(self) -> MessageReader<U, R> {
        MessageReader {
            framed: self
                .framed
                .map_decoder(|codec| JsonLinesCodec::with_max_line_bytes(codec.max_line_bytes)),
        }
    }

    /// The underlying reader; bytes already received but not read are lost.
    pub fn into_inner(self) -> R {
        self.framed.into_inner()
    }
}

/// Frames free text as lines of at most a bound, cutting longer ones into
/// pieces: for text written for people, where a long line must not end the
/// stream. Pieces are decoded lossily (invalid UTF-8 becomes `U+FFFD`) and
/// carry no line end.
#[derive(Clone, Copy, Debug)]
pub struct TextLinesCodec {
    max_line_bytes: usize,
}

impl TextLinesCodec {
    /// A codec yielding pieces of at most `max_line_bytes` (at least 1).
    pub fn new(max_line_bytes: usize) -> Self {
        TextLinesCodec {
            max_line_bytes: max_line_bytes.max(1),
        }
    }

    fn piece(buf: &mut BytesMut, end: usize, skip: usize) -> String {
        let piece = buf.split_to(end);
        let _ = buf.split_to(skip);
        let text = String::from_utf8_lossy(&piece);
        text.trim_end_matches('\r').to_owned()
    }
}

impl Decoder for TextLinesCodec {
    type Item = String;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<String>, std::io::Error> {
        let window = buf.len().min(self.max_line_bytes);
        if let Some(newline) = buf[..window].iter().position(|b| *b == b'\n') {
            return Ok(Some(Self::piece(buf, newline, 1)));
        }
        if buf.len() >= self.max_line_bytes {
            return Ok(Some(Self::piece(buf, self.max_line_bytes, 0)));
        }
        Ok(None)
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<String>, std::io::Error> {
        match self.decode(buf)? {
            Some(line) => Ok(Some(line)),
            None if buf.is_empty() => Ok(None),
            None => {
                let len = buf.len();
                Ok(Some(Self::piece(buf, len, 0)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ControlReply;

    async fn read_all(input: &[u8]) -> Vec<Result<Option<ControlReply>, String>> {
        let mut reader = MessageReader::<ControlReply, _>::new(input);
        let mut out = Vec::new();
        for _ in 0..8 {
            let result = reader.next().await.map_err(|e| e.to_string());
            let stop = !matches!(result, Ok(Some(_)));
            out.push(result);
            if stop {
                break;
            }
        }
        out
    }

    #[tokio::test]
    async fn a_line_of_exactly_the_bound_is_accepted_and_one_more_byte_is_not() {
        let line = encode_message(&ControlReply::Refused {
            reason: String::new(),
        })
        .unwrap();
        let padding = LINE_BYTES_MAX - line.len();
        let reason = "x".repeat(padding);
        let fits = encode_message(&ControlReply::Refused {
            reason: reason.clone(),
        })
        .unwrap();
        assert_eq!(fits.len(), LINE_BYTES_MAX);
        assert_eq!(
            read_all(&fits).await,
            vec![Ok(Some(ControlReply::Refused { reason })), Ok(None)]
        );
        let mut over = fits.clone();
        over.insert(over.len() - 3, b'y');
        assert_eq!(
            read_all(&over).await,
            vec![Err(format!("line longer than {LINE_BYTES_MAX} bytes"))]
        );
    }

    #[tokio::test]
    async fn a_dropped_read_loses_no_part_of_a_line() {
        let (mut write, read) = tokio::io::duplex(64);
        let mut reader = MessageReader::<ControlReply, _>::new(read);
        write.write_all(b"{\"type\":\"acc").await.unwrap();
        // The read waits for the rest of the line; give up on it.
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(20), reader.next()).await;
        assert!(pending.is_err(), "no whole line yet");
        write.write_all(b"epted\"}\n").await.unwrap();
        drop(write);
        assert_eq!(reader.next().await.unwrap(), Some(ControlReply::Accepted));
        assert_eq!(reader.next().await.unwrap(), None);
    }

    #[tokio::test]
    async fn text_lines_are_cut_not_refused() {
        let input = b"short\r\nabcdefghij\nend";
        let mut framed = FramedRead::new(&input[..], TextLinesCodec::new(4));
        let mut pieces = Vec::new();
        while let Some(piece) = framed.next().await {
            pieces.push(piece.unwrap());
        }
        assert_eq!(
            pieces,
            ["shor", "t", "abcd", "efgh", "ij", "end"].map(str::to_owned)
        );
    }
}

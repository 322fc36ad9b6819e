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
//!
//! [`LossyLinesCodec`] is the same framing for a peer that may misbehave but
//! must not be cut off for it (an exec provider program's standard output and
//! error): it yields each line's bytes as they are, and a line over the bound
//! is skipped and reported by its length ([`LossyLine::TooLong`]) while the
//! lines after it are read as usual.

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

/// Encodes `message` as one line of at most `max_line_bytes`, newline
/// included: [`encode_message`] for a channel whose readers use
/// [`JsonLinesCodec::with_max_line_bytes`].
///
/// # Errors
/// As [`encode_message`], with [`CodecError::LineTooLong`] over
/// `max_line_bytes`.
pub fn encode_message_with_max_line_bytes<M: Serialize>(
    message: &M,
    max_line_bytes: usize,
) -> Result<Vec<u8>, CodecError> {
    encode_line(message, max_line_bytes)
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
    write_message_with_max_line_bytes(writer, message, LINE_BYTES_MAX).await
}

/// Writes `message` as one line of at most `max_line_bytes`, newline
/// included, and flushes: [`write_message`] for a channel whose readers use
/// [`JsonLinesCodec::with_max_line_bytes`]. Not cancel-safe.
///
/// # Errors
/// As [`write_message`], with [`CodecError::LineTooLong`] over
/// `max_line_bytes`.
pub async fn write_message_with_max_line_bytes<M, W>(
    writer: &mut W,
    message: &M,
    max_line_bytes: usize,
) -> Result<(), CodecError>
where
    M: Serialize,
    W: AsyncWrite + Unpin,
{
    let line = encode_line(message, max_line_bytes)?;
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

/// One line out of a [`LossyLinesCodec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossyLine {
    /// A line, without its newline (and without a `\r` before it).
    Text(Vec<u8>),
    /// A line longer than the bound, of this many bytes (a `\r` before its
    /// newline included), discarded.
    TooLong(usize),
}

/// Frames a byte stream as lines of at most a bound, skipping longer lines
/// instead of failing: a [`Decoder`] of [`LossyLine`]s. At most the bound
/// and two bytes of a line are held in memory, however long the line is.
///
/// The bound excludes the newline, and a `\r` before the newline is allowed
/// on top of it. A last line without a newline is a line too.
#[derive(Clone, Copy, Debug)]
pub struct LossyLinesCodec {
    /// The longest line yielded as text, newline and `\r` excluded.
    max_line_bytes: usize,
    /// While skipping an over-long line: its bytes seen so far.
    skipped: Option<usize>,
    /// Where to resume the search for a newline: the bytes before it were
    /// searched by an earlier call.
    searched: usize,
}

impl LossyLinesCodec {
    /// A codec yielding lines of at most `max_line_bytes` as text, newline
    /// (and a `\r` before it) excluded.
    pub fn new(max_line_bytes: usize) -> Self {
        LossyLinesCodec {
            max_line_bytes,
            skipped: None,
            searched: 0,
        }
    }

    /// The longest line yielded as text, newline excluded.
    pub fn max_line_bytes(&self) -> usize {
        self.max_line_bytes
    }

    /// The longest run of bytes before a newline worth keeping: the bound
    /// and room for a `\r`.
    fn window(&self) -> usize {
        self.max_line_bytes.saturating_add(1)
    }

    /// Takes the first `end` bytes of `buf` as a line, and `skip` bytes
    /// after them (its newline) with it.
    fn line(&mut self, buf: &mut BytesMut, end: usize, skip: usize) -> LossyLine {
        self.searched = 0;
        let mut line = buf.split_to(end).to_vec();
        let _ = buf.split_to(skip);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        if line.len() > self.max_line_bytes {
            return LossyLine::TooLong(line.len());
        }
        LossyLine::Text(line)
    }
}

impl Decoder for LossyLinesCodec {
    type Item = LossyLine;
    type Error = std::io::Error;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<LossyLine>, std::io::Error> {
        if self.skipped.is_none() {
            // Search no further than a line may reach: one byte past the
            // window means the line is too long whatever follows.
            let reach = buf.len().min(self.window().saturating_add(1));
            let from = self.searched.min(reach);
            if let Some(offset) = buf[from..reach].iter().position(|b| *b == b'\n') {
                return Ok(Some(self.line(buf, from + offset, 1)));
            }
            if buf.len() <= self.window() {
                self.searched = reach;
                return Ok(None);
            }
            // Over the window without a newline: skip the line.
            self.searched = 0;
            self.skipped = Some(0);
        }
        let skipped = self.skipped.unwrap_or(0);
        match buf.iter().position(|b| *b == b'\n') {
            Some(newline) => {
                let _ = buf.split_to(newline + 1);
                self.skipped = None;
                Ok(Some(LossyLine::TooLong(skipped.saturating_add(newline))))
            }
            None => {
                self.skipped = Some(skipped.saturating_add(buf.len()));
                buf.clear();
                Ok(None)
            }
        }
    }

    fn decode_eof(&mut self, buf: &mut BytesMut) -> Result<Option<LossyLine>, std::io::Error> {
        if let Some(line) = self.decode(buf)? {
            return Ok(Some(line));
        }
        if let Some(skipped) = self.skipped.take() {
            return Ok(Some(LossyLine::TooLong(skipped)));
        }
        if buf.is_empty() {
            return Ok(None);
        }
        let end = buf.len();
        Ok(Some(self.line(buf, end, 0)))
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

    /// Feeds `input` to a fresh codec `chunk` bytes at a time, then ends
    /// the stream: every line it yields.
    fn lossy_lines(max_line_bytes: usize, input: &[u8], chunk: usize) -> Vec<LossyLine> {
        let mut codec = LossyLinesCodec::new(max_line_bytes);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for piece in input.chunks(chunk.max(1)) {
            buf.extend_from_slice(piece);
            while let Some(line) = codec.decode(&mut buf).unwrap() {
                out.push(line);
            }
        }
        while let Some(line) = codec.decode_eof(&mut buf).unwrap() {
            out.push(line);
        }
        out
    }

    #[test]
    fn lossy_lines_skip_a_long_line_and_read_on_whatever_the_chunking() {
        let input = b"abcd\r\nabcde\nabcdefghij\r\n\nlast";
        for chunk in 1..=input.len() {
            assert_eq!(
                lossy_lines(4, input, chunk),
                vec![
                    LossyLine::Text(b"abcd".to_vec()),
                    LossyLine::TooLong(5),
                    LossyLine::TooLong(11),
                    LossyLine::Text(Vec::new()),
                    LossyLine::Text(b"last".to_vec()),
                ],
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn lossy_lines_report_a_long_unterminated_last_line_by_its_length() {
        for chunk in [1, 3, 100] {
            assert_eq!(
                lossy_lines(4, b"ok\n0123456789", chunk),
                vec![LossyLine::Text(b"ok".to_vec()), LossyLine::TooLong(10)]
            );
            assert_eq!(lossy_lines(4, b"01234", chunk), vec![LossyLine::TooLong(5)]);
            assert_eq!(lossy_lines(4, b"", chunk), Vec::<LossyLine>::new());
        }
    }

    #[tokio::test]
    async fn lossy_lines_keep_a_partly_received_line_across_reads() {
        let (mut write, read) = tokio::io::duplex(64);
        let mut framed = FramedRead::new(read, LossyLinesCodec::new(16));
        write.write_all(b"{\"id\":").await.unwrap();
        let pending =
            tokio::time::timeout(std::time::Duration::from_millis(20), framed.next()).await;
        assert!(pending.is_err(), "no whole line yet");
        write.write_all(b"1}\n").await.unwrap();
        drop(write);
        assert_eq!(
            framed.next().await.unwrap().unwrap(),
            LossyLine::Text(b"{\"id\":1}".to_vec())
        );
        assert!(framed.next().await.is_none());
    }
}

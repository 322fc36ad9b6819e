//! Errors that point into a shape file, and the tools that build them: the
//! [`ShapeFileError`] (file, line, column, field, message), the [`Locator`]
//! that turns a byte range of the file into a line and column and
//! deserializes a part of the file with its field path, and how an error
//! echoes a value of the file.
//!
//! Both the generic shape-file parser and every provider's module place
//! their errors with these, so this module imports neither of them.
//!
//! A value of the file that an error echoes is cut to its first
//! [`ECHO_CHARS_MAX`] characters, followed by `… (N characters)`.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;
use toml::de::{DeTable, DeValue, ValueDeserializer};

/// The most characters of one of the file's values (a name, a key, a
/// string) that an error echoes; longer values are cut to this many,
/// followed by `… (N characters)`. Valid names have at most 63.
pub(crate) const ECHO_CHARS_MAX: usize = 64;

/// The most characters of an error's message, whatever it quotes.
pub(crate) const MESSAGE_CHARS_MAX: usize = 1024;

/// `text` itself when it has at most `max` characters; else its first `max`
/// characters followed by `… (N characters)`.
pub(crate) fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((end, _)) => format!(
            "{}\u{2026} ({} characters)",
            &text[..end],
            text.chars().count()
        ),
    }
}

/// A value of the file as an error echoes it: quoted, and cut when long
/// (`"aaaa"… (5000 characters)`).
pub(crate) fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_CHARS_MAX) {
        None => format!("{value:?}"),
        Some((end, _)) => format!(
            "{:?}\u{2026} ({} characters)",
            &value[..end],
            value.chars().count()
        ),
    }
}

/// A number of the file as an error echoes it: a huge one in scientific
/// notation rather than with its hundreds of digits.
pub(crate) fn echo_number(number: f64) -> String {
    let plain = number.to_string();
    if plain.chars().count() <= ECHO_CHARS_MAX {
        plain
    } else {
        format!("{number:e}")
    }
}

/// Cuts the long quoted parts (`"..."` with escapes, or `` `...` ``) of a
/// message built elsewhere (the TOML parser, serde), which may quote a
/// value of the file whole; then bounds the whole message.
pub(crate) fn cut_quoted(message: &str) -> String {
    let mut out = String::with_capacity(message.len().min(MESSAGE_CHARS_MAX));
    let mut chars = message.chars();
    while let Some(c) = chars.next() {
        if c != '"' && c != '`' {
            out.push(c);
            continue;
        }
        let mut inner = String::new();
        let mut closed = false;
        while let Some(next) = chars.next() {
            if next == c {
                closed = true;
                break;
            }
            inner.push(next);
            if c == '"' && next == '\\' {
                if let Some(escaped) = chars.next() {
                    inner.push(escaped);
                }
            }
        }
        let close = if closed { c.to_string() } else { String::new() };
        match inner.char_indices().nth(ECHO_CHARS_MAX) {
            None => {
                out.push(c);
                out.push_str(&inner);
                out.push_str(&close);
            }
            Some((end, _)) => {
                let total = inner.chars().count();
                out.push(c);
                out.push_str(&inner[..end]);
                out.push_str(&close);
                out.push_str(&format!("\u{2026} ({total} characters)"));
            }
        }
    }
    cut(&out, MESSAGE_CHARS_MAX)
}

/// A shape file that could not be used. Displays as
/// `FILE:LINE:COLUMN: field `PATH`: MESSAGE`, omitting what is unknown.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) struct ShapeFileError {
    /// The file.
    pub(crate) path: PathBuf,
    /// The 1-based line, when known.
    pub(crate) line: Option<usize>,
    /// The 1-based column, when known.
    pub(crate) column: Option<usize>,
    /// The field, as a dotted path (`group[1].boot.start_command`), when known.
    pub(crate) field: Option<String>,
    /// What is wrong.
    pub(crate) message: String,
}

impl fmt::Display for ShapeFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        f.write_str(": ")?;
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

/// Where a byte offset sits in a text.
pub(crate) fn line_column(source: &str, offset: usize) -> (usize, usize) {
    let before = &source[..offset.min(source.len())];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map_or(before.chars().count(), |newline| {
            before[newline + 1..].chars().count()
        })
        + 1;
    (line, column)
}

/// Builds errors that point into one file, and deserializes its parts.
pub(crate) struct Locator<'a> {
    /// The file, for messages and for paths relative to it.
    pub(crate) path: &'a Path,
    /// Its text.
    pub(crate) source: &'a str,
}

impl<'a> Locator<'a> {
    /// An error about the bytes `span` of the file (line and column
    /// unknown without it) and the dotted `field`.
    pub(crate) fn error(
        &self,
        span: Option<Range<usize>>,
        field: Option<String>,
        message: impl Into<String>,
    ) -> ShapeFileError {
        let (line, column) = match span {
            Some(span) => {
                let (line, column) = line_column(self.source, span.start);
                (Some(line), Some(column))
            }
            None => (None, None),
        };
        ShapeFileError {
            path: self.path.to_owned(),
            line,
            column,
            field: field.map(|field| cut(&field, MESSAGE_CHARS_MAX)),
            message: cut(&message.into(), MESSAGE_CHARS_MAX),
        }
    }

    /// The file as a TOML tree whose every key and value keeps its place.
    ///
    /// # Errors
    /// The TOML parser's first error, at its place.
    pub(crate) fn tree(&self) -> Result<Spanned<DeTable<'a>>, ShapeFileError> {
        DeTable::parse(self.source)
            .map_err(|error| self.error(error.span(), None, cut_quoted(error.message().trim_end())))
    }

    /// Deserializes `T` from the file's tree (the whole document, or one
    /// part of it) with every error placed: its line, and its field as a
    /// dotted path below `at_field` (`None` for the document itself).
    ///
    /// # Errors
    /// The first value that does not fit `T`.
    pub(crate) fn deserialize<'de, T, D>(
        &self,
        deserializer: D,
        at_field: Option<&str>,
    ) -> Result<T, ShapeFileError>
    where
        T: Deserialize<'de>,
        D: serde::Deserializer<'de, Error = toml::de::Error>,
    {
        serde_path_to_error::deserialize(deserializer).map_err(|error| {
            let below = field_path(error.path());
            let field = match (at_field, below) {
                (None, below) => below,
                (Some(at), None) => Some(at.to_owned()),
                (Some(at), Some(below)) if below.starts_with('[') => Some(format!("{at}{below}")),
                (Some(at), Some(below)) => Some(format!("{at}.{below}")),
            };
            let inner = error.into_inner();
            let message = in_words(inner.message().trim_end());
            self.error(inner.span(), field, cut_quoted(&message))
        })
    }

    /// Deserializes `T` from one value of the file's tree, the field
    /// `at_field` (`providers.ssh`, `group[1].slurm`): how a provider's
    /// module reads the parts of the file that are its own.
    ///
    /// # Errors
    /// The first value that does not fit `T`, placed.
    pub(crate) fn deserialize_value<'de, T: Deserialize<'de>>(
        &self,
        value: Spanned<DeValue<'de>>,
        at_field: &str,
    ) -> Result<T, ShapeFileError> {
        self.deserialize(ValueDeserializer::from(value), Some(at_field))
    }
}

/// A dotted field path (`group[1].boot.env`) without the private segments
/// that span-tracking wrappers add; `None` for the value itself.
fn field_path(path: &serde_path_to_error::Path) -> Option<String> {
    use serde_path_to_error::Segment;
    let mut text = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => text.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if key.starts_with("$__") {
                    continue;
                }
                if !text.is_empty() {
                    text.push('.');
                }
                text.push_str(&cut(key, ECHO_CHARS_MAX));
            }
            Segment::Unknown => {}
        }
    }
    (!text.is_empty()).then_some(text)
}

/// serde's message with the Rust type it expected put in words
/// (`invalid value: integer \`-1\`, expected u32` reads `invalid value:
/// integer \`-1\`; must be a whole number from 0 to 4294967295`): a file's
/// author need not know Rust's integer types.
pub(crate) fn in_words(message: &str) -> String {
    const TYPES: [(&str, &str); 8] = [
        ("u8", "a whole number from 0 to 255"),
        ("u16", "a whole number from 0 to 65535"),
        ("u32", "a whole number from 0 to 4294967295"),
        ("u64", "a whole number from 0 to 18446744073709551615"),
        ("usize", "a whole number from 0 to 18446744073709551615"),
        ("i32", "a whole number from -2147483648 to 2147483647"),
        (
            "i64",
            "a whole number from -9223372036854775808 to 9223372036854775807",
        ),
        ("f64", "a number"),
    ];
    for (rust, words) in TYPES {
        if let Some(head) = message.strip_suffix(&format!(", expected {rust}")) {
            return format!("{head}; must be {words}");
        }
        if message == format!("expected {rust}") {
            return format!("must be {words}");
        }
    }
    message.to_owned()
}

/// serde's list of the names it expected, as its unknown-field messages
/// show it: `` `a` ``, `` `a` or `b` ``, `` one of `a`, `b`, `c` ``.
pub(crate) fn expected_names(names: &[&str]) -> String {
    match names {
        [] => "nothing".to_owned(),
        [one] => format!("`{one}`"),
        [first, second] => format!("`{first}` or `{second}`"),
        more => {
            let quoted: Vec<String> = more.iter().map(|name| format!("`{name}`")).collect();
            format!("one of {}", quoted.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_value_is_echoed_whole() {
        let name = "b".repeat(ECHO_CHARS_MAX);
        assert_eq!(echo(&name), format!("{name:?}"));
        assert_eq!(cut(&name, ECHO_CHARS_MAX), name);
        assert_eq!(
            cut_quoted(&format!("x `{name}` y")),
            format!("x `{name}` y")
        );
        assert_eq!(
            echo("é".repeat(70).as_str()),
            format!("{:?}\u{2026} (70 characters)", "é".repeat(64)),
            "characters, not bytes"
        );
    }

    #[test]
    fn a_quoted_value_with_escapes_or_without_its_closing_quote_is_cut_too() {
        let inner = "\\\"".repeat(50);
        let cut_text = cut_quoted(&format!("string \"{inner}\", expected u32"));
        assert!(
            cut_text.ends_with("\u{2026} (100 characters), expected u32"),
            "{cut_text}"
        );
        let unclosed = cut_quoted(&format!("key `{}", "c".repeat(300)));
        assert_eq!(
            unclosed,
            format!("key `{}\u{2026} (300 characters)", "c".repeat(64))
        );
        let bounded = cut_quoted(&"d ".repeat(MESSAGE_CHARS_MAX));
        assert!(
            bounded.chars().count() < MESSAGE_CHARS_MAX + 32,
            "{bounded}"
        );
    }

    #[test]
    fn line_and_column_count_from_one() {
        assert_eq!(line_column("ab\ncd", 0), (1, 1));
        assert_eq!(line_column("ab\ncd", 4), (2, 2));
        assert_eq!(line_column("ab", 99), (1, 3));
    }

    #[test]
    fn an_integer_out_of_range_is_explained_without_rust_types() {
        assert_eq!(
            in_words("invalid value: integer `-1`, expected u32"),
            "invalid value: integer `-1`; must be a whole number from 0 to 4294967295"
        );
        assert_eq!(
            in_words("invalid type: string \"3\", expected u64"),
            "invalid type: string \"3\"; must be a whole number from 0 to 18446744073709551615"
        );
        assert_eq!(in_words("unknown field `x`"), "unknown field `x`");
    }

    #[test]
    fn expected_names_read_as_serde_writes_them() {
        assert_eq!(expected_names(&["a"]), "`a`");
        assert_eq!(expected_names(&["a", "b"]), "`a` or `b`");
        assert_eq!(expected_names(&["a", "b", "c"]), "one of `a`, `b`, `c`");
    }
}

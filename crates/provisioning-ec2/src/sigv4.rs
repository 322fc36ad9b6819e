//! AWS Signature Version 4 for the EC2 Query API: one `POST` with a
//! form-encoded body, signed over the headers `content-type`, `host` and
//! `x-amz-date` (and `x-amz-security-token` with temporary credentials).
//!
//! Written here on `hmac` and `sha2` (already in the workspace) rather than
//! taken from `aws-sigv4`: ARCHITECTURE.md records the measured cost that
//! decided it. The test at the bottom checks the derivation against the
//! example AWS publishes in its signing documentation.

use hmac::{KeyInit, Mac};
use sha2::{Digest, Sha256};

use crate::credentials::Credentials;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The signing algorithm's name, as it appears in the header.
const ALGORITHM: &str = "AWS4-HMAC-SHA256";

/// A moment in the two forms SigV4 uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SigningTime {
    /// `YYYYMMDD`.
    pub(crate) date: String,
    /// `YYYYMMDDTHHMMSSZ`.
    pub(crate) timestamp: String,
}

impl SigningTime {
    /// The moment `unix_seconds` after the epoch, in UTC.
    pub(crate) fn from_unix(unix_seconds: u64) -> Self {
        let days = unix_seconds / 86_400;
        let rest = unix_seconds % 86_400;
        let (year, month, day) = civil_from_days(days as i64);
        let date = format!("{year:04}{month:02}{day:02}");
        let timestamp = format!(
            "{date}T{:02}{:02}{:02}Z",
            rest / 3600,
            (rest / 60) % 60,
            rest % 60
        );
        SigningTime { date, timestamp }
    }

    /// Now, from the system clock.
    pub(crate) fn now() -> Self {
        let seconds = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        SigningTime::from_unix(seconds)
    }
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's well-known algorithm, written out for this crate).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// What a request needs besides its body to be signed.
#[derive(Clone, Debug)]
pub(crate) struct SigningScope<'a> {
    /// The region (`us-east-1`).
    pub(crate) region: &'a str,
    /// The service (`ec2`).
    pub(crate) service: &'a str,
    /// The `host` header's value (with a port when not the default).
    pub(crate) host: &'a str,
    /// The request's path (`/`).
    pub(crate) path: &'a str,
}

/// The headers a signed request carries, name and value.
pub(crate) type SignedHeaders = Vec<(&'static str, String)>;

fn hex_sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn hmac(key: &[u8], data: &[u8]) -> Vec<u8> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(data);
    mac.finalize().into_bytes().to_vec()
}

/// The key of a day, region and service (`kSigning` in AWS's terms).
pub(crate) fn signing_key(secret: &str, date: &str, region: &str, service: &str) -> Vec<u8> {
    let k_date = hmac(format!("AWS4{secret}").as_bytes(), date.as_bytes());
    let k_region = hmac(&k_date, region.as_bytes());
    let k_service = hmac(&k_region, service.as_bytes());
    hmac(&k_service, b"aws4_request")
}

/// The headers of a signed request of `method` with `query` (already
/// canonical: sorted and encoded) and `body`, with content type
/// `content_type`: `content-type`, `host`, `x-amz-date`, the token when the
/// credentials have one, and `authorization`.
pub(crate) fn sign(
    credentials: &Credentials,
    scope: &SigningScope<'_>,
    time: &SigningTime,
    method: &str,
    query: &str,
    content_type: &str,
    body: &[u8],
) -> SignedHeaders {
    let mut headers: Vec<(&'static str, String)> = vec![
        ("content-type", content_type.to_owned()),
        ("host", scope.host.to_owned()),
        ("x-amz-date", time.timestamp.clone()),
    ];
    if let Some(token) = &credentials.session_token {
        headers.push(("x-amz-security-token", token.clone()));
    }
    // Already in lowercase and sorted order.
    let canonical_headers: String = headers
        .iter()
        .map(|(name, value)| format!("{name}:{}\n", value.trim()))
        .collect();
    let signed_headers = headers
        .iter()
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(";");
    let canonical_request = format!(
        "{method}\n{}\n{query}\n{canonical_headers}\n{signed_headers}\n{}",
        scope.path,
        hex_sha256(body)
    );
    let credential_scope = format!(
        "{}/{}/{}/aws4_request",
        time.date, scope.region, scope.service
    );
    let string_to_sign = format!(
        "{ALGORITHM}\n{}\n{credential_scope}\n{}",
        time.timestamp,
        hex_sha256(canonical_request.as_bytes())
    );
    let key = signing_key(
        &credentials.secret_access_key,
        &time.date,
        scope.region,
        scope.service,
    );
    let signature = hex::encode(hmac(&key, string_to_sign.as_bytes()));
    headers.push((
        "authorization",
        format!(
            "{ALGORITHM} Credential={}/{credential_scope}, SignedHeaders={signed_headers}, Signature={signature}",
            credentials.access_key_id
        ),
    ));
    headers
}

/// Percent-encodes `text` the way SigV4 and the Query API want it: every
/// byte but the unreserved characters `A-Z a-z 0-9 - _ . ~`.
pub(crate) fn uri_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example_credentials() -> Credentials {
        Credentials {
            access_key_id: "AKIDEXAMPLE".to_owned(),
            secret_access_key: "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY".to_owned(),
            session_token: None,
        }
    }

    #[test]
    fn the_signing_key_matches_the_documented_example() {
        let key = signing_key(
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            "20150830",
            "us-east-1",
            "iam",
        );
        assert_eq!(
            hex::encode(key),
            "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9"
        );
    }

    #[test]
    fn the_signature_matches_the_documented_list_users_example() {
        let scope = SigningScope {
            region: "us-east-1",
            service: "iam",
            host: "iam.amazonaws.com",
            path: "/",
        };
        let time = SigningTime::from_unix(1_440_938_160);
        assert_eq!(time.timestamp, "20150830T123600Z");
        let headers = sign(
            &example_credentials(),
            &scope,
            &time,
            "GET",
            "Action=ListUsers&Version=2010-05-08",
            "application/x-www-form-urlencoded; charset=utf-8",
            b"",
        );
        let authorization = &headers.last().expect("authorization").1;
        assert!(
            authorization.ends_with(
                "Signature=5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7"
            ),
            "{authorization}"
        );
        assert!(authorization.contains(
            "Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, SignedHeaders=content-type;host;x-amz-date,"
        ));
    }

    #[test]
    fn dates_are_civil_dates_in_utc() {
        assert_eq!(SigningTime::from_unix(0).timestamp, "19700101T000000Z");
        assert_eq!(
            SigningTime::from_unix(951_782_400).date,
            "20000229",
            "a leap day"
        );
        assert_eq!(
            SigningTime::from_unix(1_767_225_599).timestamp,
            "20251231T235959Z"
        );
    }

    #[test]
    fn only_unreserved_characters_stay_unencoded() {
        assert_eq!(uri_encode("a-b_c.d~e"), "a-b_c.d~e");
        assert_eq!(uri_encode("a b/c=d+é"), "a%20b%2Fc%3Dd%2B%C3%A9");
    }
}

//! Credentials and region from the standard AWS chain: the environment
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_PROFILE`), then the shared
//! `~/.aws/credentials` and `~/.aws/config` files (or the files
//! `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE` name) for a profile.
//!
//! Not served (yet): instance metadata (IMDS), SSO, `credential_process`
//! and role assumption; a profile that needs them is refused by name.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Signing credentials. The secret and the token never appear in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id (`AKIA…`).
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: String,
    /// The session token of temporary credentials.
    pub session_token: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// What the chain found: credentials and the region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AwsIdentity {
    /// The credentials.
    pub credentials: Credentials,
    /// The region, when the chain names one.
    pub region: Option<String>,
}

/// The chain found no usable credentials.
#[derive(Debug, Error)]
pub enum CredentialsError {
    /// Neither the environment nor the profile holds credentials.
    #[error(
        "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or put profile {profile:?} in {}",
        credentials_file.display()
    )]
    Missing {
        /// The profile looked for.
        profile: String,
        /// The credentials file looked in.
        credentials_file: PathBuf,
    },
    /// The profile exists but needs a source this crate does not serve.
    #[error(
        "profile {profile:?} uses {key}, which the ec2 provider does not serve; export static or temporary credentials instead"
    )]
    Unsupported {
        /// The profile.
        profile: String,
        /// The key naming the source.
        key: String,
    },
    /// A shared file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The sections of an INI-style shared file: section name → key → value.
type Sections = BTreeMap<String, BTreeMap<String, String>>;

fn parse_ini(text: &str) -> Sections {
    let mut sections = Sections::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim().to_owned();
            sections.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        if let (Some(section), Some((key, value))) = (&current, line.split_once('=')) {
            sections
                .entry(section.clone())
                .or_default()
                .insert(key.trim().to_owned(), value.trim().to_owned());
        }
    }
    sections
}

fn read_optional(path: &Path) -> Result<Option<String>, CredentialsError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CredentialsError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Resolves the chain with `env` as the environment and `home` as the home
/// directory; `profile` (the table's option) wins over `AWS_PROFILE`.
///
/// # Errors
/// [`CredentialsError`] when nothing usable is found.
pub fn resolve_with(
    env: impl Fn(&str) -> Option<String>,
    home: Option<&Path>,
    profile: Option<&str>,
) -> Result<AwsIdentity, CredentialsError> {
    let profile = profile
        .map(str::to_owned)
        .or_else(|| env("AWS_PROFILE"))
        .unwrap_or_else(|| "default".to_owned());
    let home = home.map(Path::to_owned).unwrap_or_default();
    let credentials_file = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".aws/credentials"));
    let config_file = env("AWS_CONFIG_FILE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home.join(".aws/config"));
    let config = read_optional(&config_file)?
        .map(|t| parse_ini(&t))
        .unwrap_or_default();
    // The config file names a profile's section `profile NAME`, except `default`.
    let config_section = config.get(&format!("profile {profile}")).or_else(|| {
        (profile == "default")
            .then(|| config.get("default"))
            .flatten()
    });
    let region = env("AWS_REGION")
        .or_else(|| env("AWS_DEFAULT_REGION"))
        .or_else(|| config_section.and_then(|s| s.get("region").cloned()));
    if let (Some(access_key_id), Some(secret_access_key)) =
        (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY"))
    {
        return Ok(AwsIdentity {
            credentials: Credentials {
                access_key_id,
                secret_access_key,
                session_token: env("AWS_SESSION_TOKEN"),
            },
            region,
        });
    }
    let files = read_optional(&credentials_file)?
        .map(|t| parse_ini(&t))
        .unwrap_or_default();
    // Keys may sit in the credentials file's section or the config file's.
    let sections = [files.get(&profile), config_section];
    let find = |key: &str| sections.iter().flatten().find_map(|s| s.get(key).cloned());
    if let (Some(access_key_id), Some(secret_access_key)) =
        (find("aws_access_key_id"), find("aws_secret_access_key"))
    {
        return Ok(AwsIdentity {
            credentials: Credentials {
                access_key_id,
                secret_access_key,
                session_token: find("aws_session_token"),
            },
            region,
        });
    }
    for key in [
        "role_arn",
        "sso_start_url",
        "sso_session",
        "credential_process",
    ] {
        if find(key).is_some() {
            return Err(CredentialsError::Unsupported {
                profile,
                key: key.to_owned(),
            });
        }
    }
    Err(CredentialsError::Missing {
        profile,
        credentials_file,
    })
}

/// Resolves the chain from this process's environment and `$HOME`.
///
/// # Errors
/// [`CredentialsError`] when nothing usable is found.
pub fn resolve(profile: Option<&str>) -> Result<AwsIdentity, CredentialsError> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    resolve_with(|name| std::env::var(name).ok(), home.as_deref(), profile)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn the_environment_comes_first() {
        let home = tempfile::tempdir().unwrap();
        let found = resolve_with(
            env_of(&[
                ("AWS_ACCESS_KEY_ID", "AKID"),
                ("AWS_SECRET_ACCESS_KEY", "s3cr3t-value"),
                ("AWS_SESSION_TOKEN", "t0ken-value"),
                ("AWS_DEFAULT_REGION", "eu-west-1"),
            ]),
            Some(home.path()),
            None,
        )
        .expect("found");
        assert_eq!(found.credentials.access_key_id, "AKID");
        assert_eq!(
            found.credentials.session_token.as_deref(),
            Some("t0ken-value")
        );
        assert_eq!(found.region.as_deref(), Some("eu-west-1"));
        let shown = format!("{:?}", found.credentials);
        assert!(
            !shown.contains("s3cr3t") && !shown.contains("t0ken"),
            "{shown}"
        );
    }

    #[test]
    fn a_named_profile_is_read_from_the_shared_files() {
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir(home.path().join(".aws")).unwrap();
        std::fs::write(
            home.path().join(".aws/credentials"),
            "[default]\naws_access_key_id = D\naws_secret_access_key = d\n\n[gpu]\naws_access_key_id = G\naws_secret_access_key = g\n",
        )
        .unwrap();
        std::fs::write(
            home.path().join(".aws/config"),
            "[default]\nregion = us-east-1\n[profile gpu]\nregion = us-west-2\n",
        )
        .unwrap();
        let found = resolve_with(env_of(&[]), Some(home.path()), Some("gpu")).unwrap();
        assert_eq!(found.credentials.access_key_id, "G");
        assert_eq!(found.region.as_deref(), Some("us-west-2"));
        let found = resolve_with(env_of(&[]), Some(home.path()), None).unwrap();
        assert_eq!(found.credentials.access_key_id, "D");
        assert_eq!(found.region.as_deref(), Some("us-east-1"));
        let found =
            resolve_with(env_of(&[("AWS_PROFILE", "gpu")]), Some(home.path()), None).unwrap();
        assert_eq!(found.credentials.access_key_id, "G");
    }

    #[test]
    fn missing_or_unsupported_sources_are_named() {
        let home = tempfile::tempdir().unwrap();
        let error = resolve_with(env_of(&[]), Some(home.path()), None).unwrap_err();
        assert!(error.to_string().contains("no AWS credentials"), "{error}");
        std::fs::create_dir(home.path().join(".aws")).unwrap();
        std::fs::write(
            home.path().join(".aws/config"),
            "[profile sso]\nsso_start_url = https://example.invalid\n",
        )
        .unwrap();
        let error = resolve_with(env_of(&[]), Some(home.path()), Some("sso")).unwrap_err();
        assert!(error.to_string().contains("sso_start_url"), "{error}");
    }
}

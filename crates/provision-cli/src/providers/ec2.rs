//! `provider = "ec2"`: cloud instances on the EC2 API (`provisioning-ec2`).
//! This module reads `[providers.ec2]` and a group's `ec2` table (folded
//! into the group's labels as `ec2.*`) and starts the plugin.
//!
//! ```toml
//! [providers.ec2]
//! region = "us-east-1"                  # optional: else AWS_REGION, AWS_DEFAULT_REGION, the profile's
//! profile = "gpu"                       # optional: the ~/.aws profile (else AWS_PROFILE, default)
//! endpoint_url = "http://127.0.0.1:5300"   # optional: an EC2-compatible endpoint
//! listen = "0.0.0.0:7300"               # optional (default 127.0.0.1:0): the swarm listener
//! advertise = "10.0.0.1:7300"           # optional: what agents dial
//! agent = "/usr/local/bin/provision-agent"  # optional: the agent's path in the image
//! address = "private"                   # optional: "private" (default) or "public"
//! request_timeout_secs = 20             # optional
//! join_timeout_secs = 300               # optional
//!
//! [[group]]
//! id = "trainer"
//! count = 2
//! provider = "ec2"
//! ec2 = { instance_type = "g5.xlarge", image = "ami-0123", subnet = "subnet-1", security_groups = ["sg-1"], spot = true }
//! ```

#[cfg(test)]
use std::any::Any;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use provisioning::RunId;
use provisioning_agent::RunSecret;
use provisioning_ec2::{
    ApiEndpoint, DEFAULT_REQUEST_TIMEOUT, Ec2AgentConfig, Ec2Plugin, Ec2PluginConfig, Ec2Settings,
    GroupShape,
};
use provisioning_runtime::PluginEntry;
use toml::Spanned;
use toml::de::DeValue;

use super::{ConfiguredProvider, PluginStart, ProviderMemo, ProviderModule};
use crate::located::{Locator, ShapeFileError};

/// The provider kind `[providers.ec2]` serves, and the name of its groups'
/// table.
const KIND: &str = "ec2";

/// The EC2 provider's module.
pub(super) struct Ec2;

/// How often the plugin lists the run's instances to find ended ones.
const LOSS_WATCH_INTERVAL: Duration = Duration::from_secs(5);

/// The region of an `endpoint_url` when nothing names one (EC2-compatible
/// servers accept any).
const ENDPOINT_DEFAULT_REGION: &str = "us-east-1";

/// A problem with its place in the file.
#[derive(Debug)]
struct Ec2FieldError {
    span: Option<Range<usize>>,
    field: String,
    message: String,
}

impl ProviderModule for Ec2 {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn needs_table(&self) -> bool {
        true
    }

    fn takes_group_table(&self) -> bool {
        true
    }

    fn configure(
        &self,
        at: &Locator<'_>,
        _run_id: &RunId,
        table: Option<Spanned<DeValue<'_>>>,
    ) -> Result<Arc<dyn ConfiguredProvider>, ShapeFileError> {
        let table: Spanned<Ec2Settings> = super::read_table(at, KIND, table)?;
        let settings = check(&table).map_err(|e| at.error(e.span, Some(e.field), e.message))?;
        Ok(Arc::new(settings))
    }

    fn group_labels(
        &self,
        at: &Locator<'_>,
        index: usize,
        labels: &BTreeMap<String, String>,
        table: Spanned<DeValue<'_>>,
    ) -> Result<BTreeMap<String, String>, ShapeFileError> {
        let field = format!("group[{index}].{KIND}");
        let table: Spanned<GroupShape> = at.deserialize_value(table, &field)?;
        table.get_ref().validate().map_err(|e| {
            at.error(
                Some(table.span()),
                Some(format!("{field}.{}", e.field)),
                e.problem,
            )
        })?;
        let mut merged = labels.clone();
        merged.extend(table.get_ref().to_labels());
        Ok(merged)
    }
}

/// `[providers.ec2]`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ec2CliSettings {
    /// The table.
    pub(crate) settings: Ec2Settings,
    /// Its endpoint, parsed.
    pub(crate) endpoint: Option<ApiEndpoint>,
}

fn check(table: &Spanned<Ec2Settings>) -> Result<Ec2CliSettings, Ec2FieldError> {
    let settings = table.get_ref().clone();
    let fail = |field: &str, message: String| Ec2FieldError {
        span: Some(table.span()),
        field: format!("providers.ec2.{field}"),
        message,
    };
    for (field, value) in [
        ("request_timeout_secs", settings.request_timeout_secs),
        ("join_timeout_secs", settings.join_timeout_secs),
    ] {
        if value == Some(0) {
            return Err(fail(field, "must be at least 1 second".to_owned()));
        }
    }
    let dialed = settings.advertise.or(settings.listen);
    if dialed.is_some_and(|a| a.ip().is_unspecified()) {
        return Err(fail(
            "advertise",
            "agents cannot dial an unspecified address: set advertise to an address of this machine the instances can reach".to_owned(),
        ));
    }
    let endpoint = settings
        .endpoint_url
        .as_deref()
        .map(ApiEndpoint::parse)
        .transpose()
        .map_err(|message| fail("endpoint_url", message))?;
    if endpoint.is_none() {
        return Err(fail(
            "endpoint_url",
            "is required for now: AWS's own endpoints need HTTPS, which the ec2 provider's client does not speak yet (an EC2-compatible http:// endpoint works)".to_owned(),
        ));
    }
    Ok(Ec2CliSettings { settings, endpoint })
}

impl ConfiguredProvider for Ec2CliSettings {
    fn start<'a>(
        &'a self,
        run_id: &'a RunId,
        secret: RunSecret,
        _memo: &'a ProviderMemo,
    ) -> PluginStart<'a> {
        Box::pin(start_ec2(run_id, secret, self))
    }

    #[cfg(test)]
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Starts the ec2 plugin for `run_id`.
///
/// # Errors
/// When no credentials are found, no region is named, the listener cannot
/// bind or the agent cannot be located.
async fn start_ec2(
    run_id: &RunId,
    secret: RunSecret,
    cli: &Ec2CliSettings,
) -> anyhow::Result<PluginEntry> {
    let settings = &cli.settings;
    let identity = provisioning_ec2::resolve(settings.profile.as_deref())
        .map_err(|e| anyhow::anyhow!("[providers.ec2]: {e}"))?;
    let region = settings
        .region
        .clone()
        .or(identity.region)
        .or_else(|| {
            cli.endpoint
                .is_some()
                .then(|| ENDPOINT_DEFAULT_REGION.to_owned())
        })
        .ok_or_else(|| {
            anyhow::anyhow!(
                "[providers.ec2]: no region: set region, or AWS_REGION, or the profile's region"
            )
        })?;
    let endpoint = cli
        .endpoint
        .clone()
        .unwrap_or_else(|| ApiEndpoint::for_region(&region));
    let config = Ec2PluginConfig {
        run_id: run_id.clone(),
        endpoint,
        region,
        credentials: identity.credentials,
        request_timeout: settings
            .request_timeout_secs
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_REQUEST_TIMEOUT),
        address: settings.address.unwrap_or_default(),
    };
    // The table's agent path (in the image), else the slim `provision-agent`
    // beside this binary, for an image built from the same install.
    let (program, args) = match &settings.agent {
        Some(path) => (path.display().to_string(), Vec::new()),
        None => {
            let (program, args) = crate::agent_binary::remote_agent_command()?;
            (program.display().to_string(), args)
        }
    };
    let listen: SocketAddr = settings
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let mut agent = Ec2AgentConfig::new(program, secret, listen);
    agent.args = args;
    agent.advertised = settings.advertise;
    if let Some(secs) = settings.join_timeout_secs {
        agent.join_timeout = Duration::from_secs(secs);
    }
    let plugin = Ec2Plugin::start(config, agent)
        .await
        .map_err(|e| anyhow::anyhow!("[providers.ec2]: {e}"))?;
    let watch = plugin.start_watch(LOSS_WATCH_INTERVAL);
    tracing::info!(swarm = ?plugin.swarm().map(|s| s.advertised()), "ec2 provider started");
    Ok(PluginEntry::new(plugin).with_shutdown(move || async move { drop(watch) }))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::shape_file::{ShapeSource, parse};

    fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
        parse(Path::new("cloud.toml"), text, &super::super::kinds())
    }

    const GOOD: &str = r#"
run = "cloud"

[providers.ec2]
endpoint_url = "http://127.0.0.1:5300"
region = "us-east-1"

[[group]]
id = "workers"
count = 2
provider = "ec2"
ec2 = { instance_type = "t3.micro", image = "ami-12c6146b", spot = true, tags = { team = "ml" } }
"#;

    #[test]
    fn an_ec2_group_carries_its_table_as_labels() {
        let source = parse_text(GOOD).expect("parses");
        let settings = source.settings::<Ec2CliSettings>().expect("ec2 settings");
        assert_eq!(
            settings.endpoint.as_ref().map(|e| e.authority.as_str()),
            Some("127.0.0.1:5300")
        );
        let labels = &source.groups[0].template.shape.labels;
        assert_eq!(
            labels.get("ec2.instance_type").map(String::as_str),
            Some("t3.micro")
        );
        assert_eq!(labels.get("ec2.tag.team").map(String::as_str), Some("ml"));
        assert_eq!(labels.get("ec2.spot").map(String::as_str), Some("true"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_their_line() {
        let text = GOOD.replace("spot = true", "gpus = 1");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("cloud.toml:12"), "{shown}");
        assert!(shown.contains("gpus"), "{shown}");
        let text = GOOD.replace("tags = { team", "tags = { \"provision:run\"");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("cloud.toml:12"), "{shown}");
        assert!(shown.contains("reserved"), "{shown}");
        let text = GOOD.replace("region =", "regoin =");
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(
            shown.contains("cloud.toml:4") || shown.contains("cloud.toml:6"),
            "{shown}"
        );
        let text = GOOD.replace(
            "http://127.0.0.1:5300",
            "https://ec2.us-east-1.amazonaws.com",
        );
        let shown = parse_text(&text).expect_err("refused").to_string();
        assert!(shown.contains("providers.ec2.endpoint_url"), "{shown}");
    }
}

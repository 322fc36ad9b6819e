//! The XML replies of the EC2 Query API, read with `roxmltree` into
//! [`Instance`] and [`StateChange`]. Elements are matched by local name, so
//! the API's namespace (and a server that omits it) does not matter.

use std::collections::BTreeMap;

use roxmltree::{Document, Node};

use crate::error::Ec2Error;

/// An instance's lifecycle state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum InstanceState {
    /// Booting: not ready.
    Pending,
    /// Running: its address is its endpoint.
    Running,
    /// Terminating.
    ShuttingDown,
    /// Gone (still listed for a while).
    Terminated,
    /// Stopping.
    Stopping,
    /// Stopped.
    Stopped,
}

impl InstanceState {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "pending" => InstanceState::Pending,
            "running" => InstanceState::Running,
            "shutting-down" => InstanceState::ShuttingDown,
            "terminated" => InstanceState::Terminated,
            "stopping" => InstanceState::Stopping,
            "stopped" => InstanceState::Stopped,
            _ => return None,
        })
    }

    /// Its name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::Pending => "pending",
            InstanceState::Running => "running",
            InstanceState::ShuttingDown => "shutting-down",
            InstanceState::Terminated => "terminated",
            InstanceState::Stopping => "stopping",
            InstanceState::Stopped => "stopped",
        }
    }

    /// Whether the instance is going or gone.
    pub fn is_ending(self) -> bool {
        matches!(
            self,
            InstanceState::ShuttingDown | InstanceState::Terminated
        )
    }

    /// The states of an instance that still exists (not ending).
    pub const LIVE: [&'static str; 4] = ["pending", "running", "stopping", "stopped"];
}

/// One instance as `DescribeInstances` or `RunInstances` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// `i-…`.
    pub id: String,
    /// Its state.
    pub state: InstanceState,
    /// Its private address.
    pub private_ip: Option<String>,
    /// Its public address.
    pub public_ip: Option<String>,
    /// Its tags.
    pub tags: BTreeMap<String, String>,
    /// The code of its state reason (`Server.SpotInstanceTermination`).
    pub state_reason: Option<String>,
    /// Its instance type.
    pub instance_type: Option<String>,
}

/// One instance's state change after `TerminateInstances`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateChange {
    /// `i-…`.
    pub id: String,
    /// The state after the call.
    pub current: InstanceState,
}

fn parse(body: &str) -> Result<Document<'_>, Ec2Error> {
    Document::parse(body).map_err(|e| Ec2Error::broken(format!("the reply is not XML: {e}")))
}

fn child<'a, 'i>(node: Node<'a, 'i>, name: &str) -> Option<Node<'a, 'i>> {
    node.children()
        .find(|c| c.is_element() && c.tag_name().name() == name)
}

fn items<'a, 'i>(node: Node<'a, 'i>, set: &str) -> Vec<Node<'a, 'i>> {
    child(node, set)
        .map(|s| {
            s.children()
                .filter(|c| c.is_element() && c.tag_name().name() == "item")
                .collect()
        })
        .unwrap_or_default()
}

fn text(node: Node<'_, '_>, name: &str) -> Option<String> {
    child(node, name)
        .and_then(|c| c.text())
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
}

fn instance(node: Node<'_, '_>) -> Result<Instance, Ec2Error> {
    let id = text(node, "instanceId").ok_or_else(|| Ec2Error::broken("an instance without id"))?;
    let state = child(node, "instanceState")
        .and_then(|s| text(s, "name"))
        .and_then(|n| InstanceState::parse(&n))
        .ok_or_else(|| Ec2Error::broken(format!("instance {id} has no known state")))?;
    let tags = items(node, "tagSet")
        .into_iter()
        .filter_map(|t| Some((text(t, "key")?, text(t, "value").unwrap_or_default())))
        .collect();
    Ok(Instance {
        id,
        state,
        private_ip: text(node, "privateIpAddress"),
        public_ip: text(node, "ipAddress"),
        tags,
        state_reason: child(node, "stateReason").and_then(|r| text(r, "code")),
        instance_type: text(node, "instanceType"),
    })
}

/// The instances of a `RunInstances` reply.
pub(crate) fn run_instances(body: &str) -> Result<Vec<Instance>, Ec2Error> {
    let document = parse(body)?;
    items(document.root_element(), "instancesSet")
        .into_iter()
        .map(instance)
        .collect()
}

/// The instances of a `DescribeInstances` page, and its `nextToken`.
pub(crate) fn describe_instances(body: &str) -> Result<(Vec<Instance>, Option<String>), Ec2Error> {
    let document = parse(body)?;
    let root = document.root_element();
    let mut instances = Vec::new();
    for reservation in items(root, "reservationSet") {
        for node in items(reservation, "instancesSet") {
            instances.push(instance(node)?);
        }
    }
    Ok((instances, text(root, "nextToken")))
}

/// The state changes of a `TerminateInstances` reply.
pub(crate) fn terminate_instances(body: &str) -> Result<Vec<StateChange>, Ec2Error> {
    let document = parse(body)?;
    items(document.root_element(), "instancesSet")
        .into_iter()
        .map(|node| {
            let id = text(node, "instanceId")
                .ok_or_else(|| Ec2Error::broken("a state change without instance id"))?;
            let current = child(node, "currentState")
                .and_then(|s| text(s, "name"))
                .and_then(|n| InstanceState::parse(&n))
                .ok_or_else(|| Ec2Error::broken(format!("instance {id} has no current state")))?;
            Ok(StateChange { id, current })
        })
        .collect()
}

/// The code and message of an error reply, when it is one.
pub(crate) fn error_code(body: &str) -> Option<(String, String)> {
    let document = Document::parse(body).ok()?;
    let error = document
        .descendants()
        .find(|n| n.is_element() && n.tag_name().name() == "Error")?;
    Some((
        text(error, "Code")?,
        text(error, "Message").unwrap_or_default(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESCRIBE: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<DescribeInstancesResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>r</requestId>
  <reservationSet><item><reservationId>r-1</reservationId>
    <instancesSet>
      <item><instanceId>i-1</instanceId><instanceState><code>16</code><name>running</name></instanceState>
        <privateIpAddress>10.0.0.5</privateIpAddress><instanceType>t3.micro</instanceType>
        <tagSet><item><key>provision:run</key><value>demo</value></item><item><key>empty</key><value/></item></tagSet>
      </item>
      <item><instanceId>i-2</instanceId><instanceState><code>48</code><name>terminated</name></instanceState>
        <stateReason><code>Server.SpotInstanceTermination</code><message>m</message></stateReason>
      </item>
    </instancesSet></item></reservationSet>
  <nextToken>page-2</nextToken>
</DescribeInstancesResponse>"#;

    #[test]
    fn a_describe_page_lists_its_instances_and_next_token() {
        let (instances, next) = describe_instances(DESCRIBE).unwrap();
        assert_eq!(next.as_deref(), Some("page-2"));
        assert_eq!(instances.len(), 2);
        assert_eq!(instances[0].state, InstanceState::Running);
        assert_eq!(instances[0].private_ip.as_deref(), Some("10.0.0.5"));
        assert_eq!(instances[0].tags["provision:run"], "demo");
        assert_eq!(instances[0].tags["empty"], "");
        assert_eq!(
            instances[1].state_reason.as_deref(),
            Some("Server.SpotInstanceTermination")
        );
    }

    #[test]
    fn an_error_reply_gives_its_code() {
        let body = "<Response><Errors><Error><Code>VcpuLimitExceeded</Code><Message>too many</Message></Error></Errors></Response>";
        assert_eq!(
            error_code(body),
            Some(("VcpuLimitExceeded".into(), "too many".into()))
        );
        assert_eq!(error_code("not xml"), None);
    }
}

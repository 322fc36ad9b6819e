//! The provider's settings (`[providers.ec2]`), a group's machine
//! ([`GroupShape`], the group's `ec2` table), and how that table travels
//! inside a node template: as `ec2.*` labels, read back by the plugin.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The prefix of the labels a group's `ec2` table becomes.
pub const LABEL_PREFIX: &str = "ec2.";

/// The prefix of tags `provision` reserves for itself.
pub const RESERVED_TAG_PREFIX: &str = "provision:";

/// The most extra tags a group may set (EC2 allows 50 a resource; the
/// provider's own take five).
pub const EXTRA_TAGS_MAX: usize = 40;

/// The largest root volume a group may ask for, in GiB (EC2's gp3 limit).
pub const ROOT_VOLUME_GIB_MAX: u32 = 16_384;

/// Which of an instance's addresses is its endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AddressChoice {
    /// The private address (the default: agents and controller share a VPC).
    #[default]
    Private,
    /// The public address.
    Public,
}

/// `[providers.ec2]` as a shape file writes it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ec2Settings {
    /// The region; else `AWS_REGION`, `AWS_DEFAULT_REGION` or the profile's.
    pub region: Option<String>,
    /// The shared-files profile; else `AWS_PROFILE` or `default`.
    pub profile: Option<String>,
    /// An EC2-compatible endpoint (`http://host:port`) instead of AWS's.
    pub endpoint_url: Option<String>,
    /// The swarm listener's address (default `0.0.0.0:7300` … the CLI's).
    pub listen: Option<SocketAddr>,
    /// The address agents dial, when it differs from `listen`.
    pub advertise: Option<SocketAddr>,
    /// The agent's path in the image (default `/usr/local/bin/provision-agent`).
    pub agent: Option<PathBuf>,
    /// Which address is the endpoint.
    pub address: Option<AddressChoice>,
    /// How long one API call may take, in seconds.
    pub request_timeout_secs: Option<u64>,
    /// How long a booted instance's agent may take to join, in seconds.
    pub join_timeout_secs: Option<u64>,
}

/// A group's machine: its `ec2` table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupShape {
    /// The instance type (`g5.xlarge`).
    pub instance_type: String,
    /// The image (AMI id).
    pub image: String,
    /// The subnet.
    pub subnet: Option<String>,
    /// The availability zone.
    pub zone: Option<String>,
    /// The key pair.
    pub key_name: Option<String>,
    /// Security group ids.
    #[serde(default)]
    pub security_groups: Vec<String>,
    /// A spot instance.
    #[serde(default)]
    pub spot: bool,
    /// The spot maximum price per hour (decimal dollars); needs `spot`.
    pub spot_max_price: Option<String>,
    /// The root volume's size in GiB.
    pub root_volume_gib: Option<u32>,
    /// Extra tags.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// A label or table value the provider refuses.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{field}: {problem}")]
pub struct ShapeError {
    /// The field (`instance_type`, `tags.provision:run`).
    pub field: String,
    /// What is wrong.
    pub problem: String,
}

fn shape_error(field: &str, problem: impl Into<String>) -> ShapeError {
    ShapeError {
        field: field.to_owned(),
        problem: problem.into(),
    }
}

impl GroupShape {
    /// Checks every field the way EC2 would, before any call.
    ///
    /// # Errors
    /// The first problem.
    pub fn validate(&self) -> Result<(), ShapeError> {
        if self.instance_type.trim().is_empty() {
            return Err(shape_error("instance_type", "must name an instance type"));
        }
        if self.image.trim().is_empty() {
            return Err(shape_error("image", "must name an image (AMI id)"));
        }
        if let Some(price) = &self.spot_max_price {
            if !self.spot {
                return Err(shape_error("spot_max_price", "needs spot = true"));
            }
            let valid = price.parse::<f64>().is_ok_and(|p| p.is_finite() && p > 0.0);
            if !valid {
                return Err(shape_error(
                    "spot_max_price",
                    format!("{price:?} is not a positive decimal price"),
                ));
            }
        }
        if let Some(gib) = self.root_volume_gib
            && !(1..=ROOT_VOLUME_GIB_MAX).contains(&gib)
        {
            return Err(shape_error(
                "root_volume_gib",
                format!("must be 1 to {ROOT_VOLUME_GIB_MAX}"),
            ));
        }
        if self.tags.len() > EXTRA_TAGS_MAX {
            return Err(shape_error(
                "tags",
                format!("at most {EXTRA_TAGS_MAX} extra tags"),
            ));
        }
        for (key, value) in &self.tags {
            let field = format!("tags.{key}");
            if key.starts_with(RESERVED_TAG_PREFIX) || key.starts_with("aws:") {
                return Err(shape_error(
                    &field,
                    format!("tags starting with {RESERVED_TAG_PREFIX:?} or \"aws:\" are reserved"),
                ));
            }
            if key.is_empty() || key.len() > 128 || value.len() > 256 {
                return Err(shape_error(
                    &field,
                    "a tag key has 1 to 128 characters, a value at most 256",
                ));
            }
        }
        for group in &self.security_groups {
            if group.is_empty() || group.contains(',') {
                return Err(shape_error(
                    "security_groups",
                    format!("{group:?} is not a security group id"),
                ));
            }
        }
        Ok(())
    }

    /// The table as template labels (each set field under [`LABEL_PREFIX`]).
    pub fn to_labels(&self) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::new();
        let mut put = |name: &str, value: Option<String>| {
            if let Some(value) = value {
                labels.insert(format!("{LABEL_PREFIX}{name}"), value);
            }
        };
        put("instance_type", Some(self.instance_type.clone()));
        put("image", Some(self.image.clone()));
        put("subnet", self.subnet.clone());
        put("zone", self.zone.clone());
        put("key_name", self.key_name.clone());
        put(
            "security_groups",
            (!self.security_groups.is_empty()).then(|| self.security_groups.join(",")),
        );
        put("spot", self.spot.then(|| "true".to_owned()));
        put("spot_max_price", self.spot_max_price.clone());
        put(
            "root_volume_gib",
            self.root_volume_gib.map(|g| g.to_string()),
        );
        for (key, value) in &self.tags {
            labels.insert(format!("{LABEL_PREFIX}tag.{key}"), value.clone());
        }
        labels
    }

    /// The table back from template labels; labels without the prefix are
    /// ignored.
    ///
    /// # Errors
    /// An unknown `ec2.*` label, a malformed value, or what
    /// [`GroupShape::validate`] refuses.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Result<Self, ShapeError> {
        let mut shape = GroupShape::default();
        for (label, value) in labels {
            let Some(name) = label.strip_prefix(LABEL_PREFIX) else {
                continue;
            };
            if let Some(tag) = name.strip_prefix("tag.") {
                shape.tags.insert(tag.to_owned(), value.clone());
                continue;
            }
            match name {
                "instance_type" => shape.instance_type = value.clone(),
                "image" => shape.image = value.clone(),
                "subnet" => shape.subnet = Some(value.clone()),
                "zone" => shape.zone = Some(value.clone()),
                "key_name" => shape.key_name = Some(value.clone()),
                "security_groups" => {
                    shape.security_groups = value.split(',').map(str::to_owned).collect();
                }
                "spot" => shape.spot = value == "true",
                "spot_max_price" => shape.spot_max_price = Some(value.clone()),
                "root_volume_gib" => {
                    shape.root_volume_gib = Some(value.parse().map_err(|_| {
                        shape_error("root_volume_gib", format!("{value:?} is not a number"))
                    })?);
                }
                _ => return Err(shape_error(label, "is no field of a group's ec2 table")),
            }
        }
        shape.validate()?;
        Ok(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> GroupShape {
        GroupShape {
            instance_type: "g5.xlarge".into(),
            image: "ami-0123".into(),
            subnet: Some("subnet-1".into()),
            security_groups: vec!["sg-1".into(), "sg-2".into()],
            spot: true,
            spot_max_price: Some("0.75".into()),
            root_volume_gib: Some(200),
            tags: BTreeMap::from([("team".into(), "ml".into())]),
            ..GroupShape::default()
        }
    }

    #[test]
    fn a_shape_survives_the_trip_through_labels() {
        let mut labels = shape().to_labels();
        labels.insert("other".into(), "ignored".into());
        assert_eq!(GroupShape::from_labels(&labels).unwrap(), shape());
    }

    #[test]
    fn bad_values_are_refused_with_their_field() {
        let check = |edit: fn(&mut GroupShape), field: &str| {
            let mut bad = shape();
            edit(&mut bad);
            let error = bad.validate().expect_err("refused");
            assert_eq!(error.field, field, "{error}");
        };
        check(|s| s.instance_type.clear(), "instance_type");
        check(|s| s.image = " ".into(), "image");
        check(|s| s.spot = false, "spot_max_price");
        check(|s| s.spot_max_price = Some("-1".into()), "spot_max_price");
        check(|s| s.root_volume_gib = Some(0), "root_volume_gib");
        check(
            |s| {
                s.tags.insert("provision:run".into(), "x".into());
            },
            "tags.provision:run",
        );
        let labels = BTreeMap::from([("ec2.gpus".to_owned(), "1".to_owned())]);
        assert_eq!(
            GroupShape::from_labels(&labels).unwrap_err().field,
            "ec2.gpus"
        );
    }
}

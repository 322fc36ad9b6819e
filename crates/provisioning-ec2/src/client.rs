//! [`Ec2Client`]: the four calls of the EC2 Query API the provider makes
//! (`RunInstances`, `DescribeInstances`, `TerminateInstances`,
//! `CreateTags`), signed with SigV4 and sent over HTTP/1.1 with `hyper`.
//!
//! The client never retries on its own (the HTTP client's retry of a
//! request cancelled on a pooled connection is turned off too): every
//! failure reaches the caller, classified by [`Ec2Error`], so the reconciler
//! decides what happens next and sees that it happened.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::credentials::Credentials;
use crate::error::Ec2Error;
use crate::response::{self, Instance, StateChange};
use crate::sigv4::{self, SigningScope, SigningTime};

/// The Query API version the client speaks.
const API_VERSION: &str = "2016-11-15";

/// The most pages one `DescribeInstances` listing follows before it gives
/// up (at [`PAGE_SIZE`] instances a page).
pub const PAGES_MAX: usize = 100;

/// Instances asked for per page of a filtered `DescribeInstances`.
const PAGE_SIZE: u32 = 1000;

/// The largest response body read.
const RESPONSE_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Where the API is and how to reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiEndpoint {
    /// `host` or `host:port`, as the `host` header carries it.
    pub authority: String,
    /// The request path (`/`).
    pub path: String,
}

impl ApiEndpoint {
    /// The endpoint of `url` (`http://host:port/`).
    ///
    /// # Errors
    /// A message when the URL is not a plain `http://` URL: HTTPS needs the
    /// TLS client the transport-security work brings (see ARCHITECTURE.md).
    pub fn parse(url: &str) -> Result<Self, String> {
        if url.starts_with("https://") {
            return Err(format!(
                "endpoint {url:?}: https is not served yet by the ec2 provider's HTTP client (it has no TLS); use an http:// endpoint"
            ));
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("endpoint {url:?} must start with http://"))?;
        let (authority, path) = match rest.find('/') {
            Some(at) => (&rest[..at], &rest[at..]),
            None => (rest, "/"),
        };
        if authority.is_empty() || authority.contains('@') {
            return Err(format!("endpoint {url:?} names no host"));
        }
        Ok(ApiEndpoint {
            authority: authority.to_owned(),
            path: path.to_owned(),
        })
    }

    /// The public endpoint of `region`.
    pub fn for_region(region: &str) -> Self {
        ApiEndpoint {
            authority: format!("ec2.{region}.amazonaws.com"),
            path: "/".to_owned(),
        }
    }
}

/// One tag filter of `DescribeInstances`: `tag:NAME` equals one of `values`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The filter's name (`tag:provision:run`, `instance-state-name`).
    pub name: String,
    /// Accepted values.
    pub values: Vec<String>,
}

impl Filter {
    /// A filter of `name` over `values`.
    pub fn new(name: impl Into<String>, values: &[&str]) -> Self {
        Filter {
            name: name.into(),
            values: values.iter().map(|v| (*v).to_owned()).collect(),
        }
    }
}

/// What `RunInstances` is asked for: one instance.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunRequest {
    /// The idempotency token (at most 64 ASCII characters).
    pub client_token: String,
    /// The AMI.
    pub image_id: String,
    /// The instance type.
    pub instance_type: String,
    /// The subnet.
    pub subnet_id: Option<String>,
    /// The availability zone.
    pub zone: Option<String>,
    /// The key pair.
    pub key_name: Option<String>,
    /// Security group ids.
    pub security_group_ids: Vec<String>,
    /// A spot instance, with an optional maximum price.
    pub spot: Option<Option<String>>,
    /// The root volume's size in GiB (on `/dev/xvda`).
    pub root_volume_gib: Option<u32>,
    /// Tags set at launch.
    pub tags: BTreeMap<String, String>,
    /// The user-data, before base64.
    pub user_data: String,
}

impl RunRequest {
    fn parameters(&self) -> Vec<(String, String)> {
        use base64::Engine;
        let mut p: Vec<(String, String)> = vec![
            ("ClientToken".into(), self.client_token.clone()),
            ("ImageId".into(), self.image_id.clone()),
            ("InstanceType".into(), self.instance_type.clone()),
            ("MinCount".into(), "1".into()),
            ("MaxCount".into(), "1".into()),
            (
                "UserData".into(),
                base64::engine::general_purpose::STANDARD.encode(&self.user_data),
            ),
        ];
        if let Some(subnet) = &self.subnet_id {
            p.push(("SubnetId".into(), subnet.clone()));
        }
        if let Some(zone) = &self.zone {
            p.push(("Placement.AvailabilityZone".into(), zone.clone()));
        }
        if let Some(key) = &self.key_name {
            p.push(("KeyName".into(), key.clone()));
        }
        for (i, group) in self.security_group_ids.iter().enumerate() {
            p.push((format!("SecurityGroupId.{}", i + 1), group.clone()));
        }
        if let Some(price) = &self.spot {
            p.push(("InstanceMarketOptions.MarketType".into(), "spot".into()));
            p.push((
                "InstanceMarketOptions.SpotOptions.SpotInstanceType".into(),
                "one-time".into(),
            ));
            if let Some(price) = price {
                p.push((
                    "InstanceMarketOptions.SpotOptions.MaxPrice".into(),
                    price.clone(),
                ));
            }
        }
        if let Some(gib) = self.root_volume_gib {
            p.push(("BlockDeviceMapping.1.DeviceName".into(), "/dev/xvda".into()));
            p.push((
                "BlockDeviceMapping.1.Ebs.VolumeSize".into(),
                gib.to_string(),
            ));
            p.push((
                "BlockDeviceMapping.1.Ebs.DeleteOnTermination".into(),
                "true".into(),
            ));
        }
        if !self.tags.is_empty() {
            p.push(("TagSpecification.1.ResourceType".into(), "instance".into()));
            for (i, (key, value)) in self.tags.iter().enumerate() {
                p.push((format!("TagSpecification.1.Tag.{}.Key", i + 1), key.clone()));
                p.push((
                    format!("TagSpecification.1.Tag.{}.Value", i + 1),
                    value.clone(),
                ));
            }
        }
        p
    }
}

/// A client of one EC2 API endpoint, region and set of credentials.
#[derive(Clone, Debug)]
pub struct Ec2Client {
    http: Client<HttpConnector, Full<Bytes>>,
    endpoint: ApiEndpoint,
    region: String,
    credentials: Credentials,
    timeout: Duration,
}

impl Ec2Client {
    /// A client of `endpoint` in `region`; each call gives up after
    /// `timeout` (an ambiguous failure).
    pub fn new(
        endpoint: ApiEndpoint,
        region: impl Into<String>,
        credentials: Credentials,
        timeout: Duration,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new())
            // No hidden retries: a request cancelled on a pooled connection
            // is a failure the caller sees.
            .retry_canceled_requests(false)
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ec2Client {
            http,
            endpoint,
            region: region.into(),
            credentials,
            timeout,
        }
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &ApiEndpoint {
        &self.endpoint
    }

    /// Sends `action` with `parameters` and returns the reply's body.
    async fn call(
        &self,
        action: &str,
        parameters: Vec<(String, String)>,
    ) -> Result<String, Ec2Error> {
        let mut all = vec![
            ("Action".to_owned(), action.to_owned()),
            ("Version".to_owned(), API_VERSION.to_owned()),
        ];
        all.extend(parameters);
        let body: String = all
            .iter()
            .map(|(k, v)| format!("{}={}", sigv4::uri_encode(k), sigv4::uri_encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let content_type = "application/x-www-form-urlencoded; charset=utf-8";
        let scope = SigningScope {
            region: &self.region,
            service: "ec2",
            host: &self.endpoint.authority,
            path: &self.endpoint.path,
        };
        let headers = sigv4::sign(
            &self.credentials,
            &scope,
            &SigningTime::now(),
            "POST",
            "",
            content_type,
            body.as_bytes(),
        );
        let uri = format!("http://{}{}", self.endpoint.authority, self.endpoint.path);
        let mut request = http::Request::post(uri);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let request = request
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Ec2Error::client("InvalidRequest", e.to_string()))?;
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(Ec2Error::from_transport)?;
            let status = response.status().as_u16();
            let collected = http_body_util::Limited::new(response.into_body(), RESPONSE_BYTES_MAX)
                .collect()
                .await
                .map_err(|e| Ec2Error::broken(format!("reading the reply: {e}")))?;
            Ok::<_, Ec2Error>((status, collected.to_bytes()))
        };
        let (status, bytes) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| Ec2Error::timeout(action, self.timeout))??;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if (200..300).contains(&status) {
            return Ok(text);
        }
        Err(Ec2Error::from_reply(status, &text))
    }

    /// `RunInstances` for one instance; the instance it made (or, for a
    /// repeated token on a server that honours tokens, the one it made
    /// before).
    ///
    /// # Errors
    /// Classified by [`Ec2Error`].
    pub async fn run_instance(&self, request: &RunRequest) -> Result<Instance, Ec2Error> {
        let body = self.call("RunInstances", request.parameters()).await?;
        let instances = response::run_instances(&body)?;
        instances
            .into_iter()
            .next()
            .ok_or_else(|| Ec2Error::broken("RunInstances answered with no instance"))
    }

    /// Every instance matching `filters` (and `instance_ids`, when given),
    /// following `NextToken` for at most [`PAGES_MAX`] pages.
    ///
    /// # Errors
    /// Classified by [`Ec2Error`]; never a partial list.
    pub async fn describe_instances(
        &self,
        filters: &[Filter],
        instance_ids: &[String],
    ) -> Result<Vec<Instance>, Ec2Error> {
        let mut instances = Vec::new();
        let mut next: Option<String> = None;
        for _ in 0..PAGES_MAX {
            let mut p = Vec::new();
            for (i, filter) in filters.iter().enumerate() {
                p.push((format!("Filter.{}.Name", i + 1), filter.name.clone()));
                for (j, value) in filter.values.iter().enumerate() {
                    p.push((format!("Filter.{}.Value.{}", i + 1, j + 1), value.clone()));
                }
            }
            for (i, id) in instance_ids.iter().enumerate() {
                p.push((format!("InstanceId.{}", i + 1), id.clone()));
            }
            // MaxResults cannot be combined with instance ids.
            if instance_ids.is_empty() {
                p.push(("MaxResults".to_owned(), PAGE_SIZE.to_string()));
            }
            if let Some(token) = &next {
                p.push(("NextToken".to_owned(), token.clone()));
            }
            let body = self.call("DescribeInstances", p).await?;
            let (page, token) = response::describe_instances(&body)?;
            instances.extend(page);
            match token {
                Some(token) if !token.is_empty() => next = Some(token),
                _ => return Ok(instances),
            }
        }
        Err(Ec2Error::broken(format!(
            "DescribeInstances still had more pages after {PAGES_MAX}"
        )))
    }

    /// `TerminateInstances` of `ids`: each one's state after the call.
    ///
    /// # Errors
    /// Classified by [`Ec2Error`]; an unknown id is
    /// `InvalidInstanceID.NotFound` ([`Ec2Error::is_not_found`]).
    pub async fn terminate_instances(&self, ids: &[String]) -> Result<Vec<StateChange>, Ec2Error> {
        let p = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (format!("InstanceId.{}", i + 1), id.clone()))
            .collect();
        let body = self.call("TerminateInstances", p).await?;
        response::terminate_instances(&body)
    }

    /// `CreateTags`: sets `tags` on the resources `ids`.
    ///
    /// # Errors
    /// Classified by [`Ec2Error`].
    pub async fn create_tags(
        &self,
        ids: &[String],
        tags: &BTreeMap<String, String>,
    ) -> Result<(), Ec2Error> {
        let mut p: Vec<(String, String)> = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (format!("ResourceId.{}", i + 1), id.clone()))
            .collect();
        for (i, (key, value)) in tags.iter().enumerate() {
            p.push((format!("Tag.{}.Key", i + 1), key.clone()));
            p.push((format!("Tag.{}.Value", i + 1), value.clone()));
        }
        self.call("CreateTags", p).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_plain_http_urls() {
        let endpoint = ApiEndpoint::parse("http://127.0.0.1:5000").unwrap();
        assert_eq!(endpoint.authority, "127.0.0.1:5000");
        assert_eq!(endpoint.path, "/");
        assert!(ApiEndpoint::parse("https://ec2.us-east-1.amazonaws.com").is_err());
        assert!(ApiEndpoint::parse("ftp://x").is_err());
        assert_eq!(
            ApiEndpoint::for_region("eu-west-1").authority,
            "ec2.eu-west-1.amazonaws.com"
        );
    }

    #[test]
    fn a_spot_request_carries_its_market_options_and_tags() {
        let request = RunRequest {
            client_token: "t".into(),
            image_id: "ami-1".into(),
            instance_type: "g5.xlarge".into(),
            spot: Some(Some("0.50".into())),
            root_volume_gib: Some(100),
            security_group_ids: vec!["sg-1".into(), "sg-2".into()],
            tags: BTreeMap::from([("a".into(), "1".into())]),
            ..RunRequest::default()
        };
        let p: BTreeMap<_, _> = request.parameters().into_iter().collect();
        assert_eq!(p["InstanceMarketOptions.MarketType"], "spot");
        assert_eq!(p["InstanceMarketOptions.SpotOptions.MaxPrice"], "0.50");
        assert_eq!(p["SecurityGroupId.2"], "sg-2");
        assert_eq!(p["BlockDeviceMapping.1.Ebs.VolumeSize"], "100");
        assert_eq!(p["TagSpecification.1.Tag.1.Key"], "a");
        assert_eq!(p["ClientToken"], "t");
    }
}

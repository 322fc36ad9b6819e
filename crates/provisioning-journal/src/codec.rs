//! The reconciler's durable form as journal rows, and back.
//!
//! The core hands out typed changes ([`provisioning::DriverChanges`]); this
//! module turns them into storage change sets ([`crate::ChangeSet`]) and a
//! committed [`crate::Snapshot`] back into a [`DurableState`] for recovery.
//!
//! Layout (see `docs/state.md`):
//! - meta `state`: the [`DurableMeta`] (desired shape, generation, allocator
//!   mark, writer's clock) as JSON;
//! - meta `template/<key>`: one [`NodeTemplate`] as JSON, written once per
//!   distinct template; `<key>` is the first 16 hex digits of the SHA-256 of
//!   that JSON, so equal templates share one row across restarts;
//! - one node row per slot: its id, attempt, stage name, and a body
//!   `{"template": "<key>", "node": <DurableNode>}`.

use std::collections::BTreeSet;
use std::sync::Arc;

use provisioning::{
    DriverChangesView, DurableEntry, DurableEntryRef, DurableMeta, DurableNode, DurableNodeRef,
    DurableState, LogicalNodeId, NodeTemplate,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::{ChangeSet, NodeRow, Snapshot};

/// The meta key of the [`DurableMeta`].
pub const META_STATE: &str = "state";

/// The prefix of the meta keys of templates.
pub const TEMPLATE_PREFIX: &str = "template/";

/// Why a state could not be encoded or decoded.
#[derive(Debug, Error)]
pub enum CodecError {
    /// A value could not be turned into JSON (not expected for these types).
    #[error("cannot encode {what}: {source}")]
    Encode {
        /// What was being encoded.
        what: String,
        /// The serializer's error.
        source: serde_json::Error,
    },
    /// A stored value is not what this version writes.
    #[error("the stored {what} is unreadable: {source}")]
    Decode {
        /// Which row.
        what: String,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// Nodes are stored but the meta is missing.
    #[error("the state holds {nodes} node(s) but no `{META_STATE}` entry")]
    MissingMeta {
        /// How many node rows there are.
        nodes: usize,
    },
    /// A node names a template that is not stored.
    #[error("node {node} names template {key}, which is not stored")]
    MissingTemplate {
        /// The node.
        node: String,
        /// The template key.
        key: String,
    },
    /// A row's columns disagree with its body.
    #[error("the row of node {row} holds node {body} attempt {attempt}")]
    RowMismatch {
        /// The row's key.
        row: String,
        /// The node its body names.
        body: String,
        /// The attempt its body names.
        attempt: u64,
    },
}

#[derive(Serialize)]
struct BodyOut<'a> {
    template: &'a str,
    node: DurableNodeRef<'a>,
}

#[derive(Deserialize)]
struct BodyIn {
    template: String,
    node: DurableNode,
}

/// Encodes change sets and decodes snapshots, remembering which templates
/// the journal already holds so that each is written once.
#[derive(Debug, Default)]
pub struct StateCodec {
    /// Templates seen, with their keys. Holding the `Arc` keeps its address
    /// from being reused while it is cached. Few distinct templates exist
    /// (one per group generation), so a scan is cheap.
    known: Vec<(Arc<NodeTemplate>, String)>,
    /// Template keys the journal holds.
    stored: BTreeSet<String>,
}

impl StateCodec {
    /// A codec for an empty journal.
    pub fn new() -> Self {
        StateCodec::default()
    }

    /// The index in `known` of `template`'s key, storing the template first
    /// when the journal does not hold it yet.
    fn template_key(
        &mut self,
        template: &Arc<NodeTemplate>,
        meta: &mut Vec<(String, String)>,
    ) -> Result<usize, CodecError> {
        if let Some(at) = self
            .known
            .iter()
            .position(|(t, _)| Arc::ptr_eq(t, template))
        {
            return Ok(at);
        }
        if let Some(key) = self
            .known
            .iter()
            .find(|(t, _)| **t == **template)
            .map(|(_, key)| key.clone())
        {
            // Another allocation of a known template: remember this one too,
            // so its next nodes are found by pointer.
            self.known.push((template.clone(), key));
            return Ok(self.known.len() - 1);
        }
        let json = serde_json::to_string(&**template).map_err(|source| CodecError::Encode {
            what: "a node template".into(),
            source,
        })?;
        let digest = Sha256::digest(json.as_bytes());
        let key = hex16(&digest);
        if self.stored.insert(key.clone()) {
            meta.push((format!("{TEMPLATE_PREFIX}{key}"), json));
        }
        self.known.push((template.clone(), key));
        Ok(self.known.len() - 1)
    }

    /// The storage change set of a core change set.
    ///
    /// # Errors
    /// [`CodecError::Encode`], which these types do not produce in practice.
    pub fn encode(
        &mut self,
        changes: &provisioning::DriverChanges,
    ) -> Result<ChangeSet, CodecError> {
        let upserts = changes
            .upserts
            .iter()
            .map(|entry| (&entry.node.node, Some(entry.as_ref())));
        let removed = changes.removed.iter().map(|id| (id, None));
        self.encode_rows(
            changes.meta.as_ref(),
            changes.upserts.len(),
            upserts.chain(removed),
        )
    }

    /// The storage change set of the changes taken from the driver
    /// ([`provisioning::ClusterDriver::take_changes`]), each changed node
    /// encoded borrowed; the same rows as [`StateCodec::encode`] of its
    /// owned form.
    ///
    /// # Errors
    /// [`CodecError::Encode`], which these types do not produce in practice.
    pub fn encode_view(
        &mut self,
        changes: &DriverChangesView<'_>,
    ) -> Result<ChangeSet, CodecError> {
        let meta = changes.meta();
        // The changed ids bound the rows written: those removed are the few.
        self.encode_rows(meta.as_ref(), changes.nodes().len(), changes.entries())
    }

    /// The rows of a change set: `meta` when anything is written, and each
    /// changed node with its entry (`None`: removed); upserts and deletes
    /// each keep the order they come in. `upserts_hint` bounds the upserts.
    fn encode_rows<'a>(
        &mut self,
        meta: Option<&DurableMeta>,
        upserts_hint: usize,
        nodes: impl Iterator<Item = (&'a LogicalNodeId, Option<DurableEntryRef<'a>>)>,
    ) -> Result<ChangeSet, CodecError> {
        let mut out = ChangeSet::new();
        out.upserts.reserve_exact(upserts_hint);
        // One buffer serves every row: each body is then copied out once, at
        // its exact size, instead of growing a fresh string per row.
        let mut scratch = Vec::with_capacity(1024);
        for (id, entry) in nodes {
            let Some(entry) = entry else {
                out.deletes.push(id.to_string());
                continue;
            };
            let key = self.template_key(entry.template, &mut out.meta)?;
            let key = &self.known[key].1;
            scratch.clear();
            serde_json::to_writer(
                &mut scratch,
                &BodyOut {
                    template: key,
                    node: entry.node,
                },
            )
            .map_err(|source| CodecError::Encode {
                what: format!("node {}", entry.node.node),
                source,
            })?;
            // serde_json writes UTF-8 only, so nothing is ever replaced.
            let body = String::from_utf8_lossy(&scratch).into_owned();
            out.upserts.push(NodeRow {
                node: entry.node.node.to_string(),
                attempt: entry.node.attempt.get(),
                stage: entry.node.record.stage.name().to_owned(),
                body,
            });
        }
        if let Some(meta) = meta {
            let json = serde_json::to_string(meta).map_err(|source| CodecError::Encode {
                what: "the state meta".into(),
                source,
            })?;
            out.meta.push((META_STATE.to_owned(), json));
        }
        Ok(out)
    }

    /// The durable state a snapshot holds; `None` when it holds nothing to
    /// recover (nothing was ever committed). The codec then knows the
    /// snapshot's templates, so later change sets do not write them again.
    ///
    /// # Errors
    /// A [`CodecError`] naming the row that is unreadable or inconsistent.
    pub fn decode(&mut self, snapshot: &Snapshot) -> Result<Option<DurableState>, CodecError> {
        for key in snapshot.meta.keys() {
            if let Some(template) = key.strip_prefix(TEMPLATE_PREFIX) {
                self.stored.insert(template.to_owned());
            }
        }
        let Some(meta) = snapshot.meta.get(META_STATE) else {
            if snapshot.nodes.is_empty() {
                return Ok(None);
            }
            return Err(CodecError::MissingMeta {
                nodes: snapshot.nodes.len(),
            });
        };
        let meta: DurableMeta =
            serde_json::from_str(meta).map_err(|source| CodecError::Decode {
                what: format!("`{META_STATE}` entry"),
                source,
            })?;
        let mut templates: Vec<(String, Arc<NodeTemplate>)> = Vec::new();
        let mut nodes = Vec::with_capacity(snapshot.nodes.len());
        for (id, row) in &snapshot.nodes {
            let body: BodyIn =
                serde_json::from_str(&row.body).map_err(|source| CodecError::Decode {
                    what: format!("row of node {id}"),
                    source,
                })?;
            if body.node.node.to_string() != *id || body.node.attempt.get() != row.attempt {
                return Err(CodecError::RowMismatch {
                    row: id.clone(),
                    body: body.node.node.to_string(),
                    attempt: body.node.attempt.get(),
                });
            }
            let template = match templates.iter().find(|(k, _)| *k == body.template) {
                Some((_, t)) => t.clone(),
                None => {
                    let stored = snapshot
                        .meta
                        .get(&format!("{TEMPLATE_PREFIX}{}", body.template))
                        .ok_or_else(|| CodecError::MissingTemplate {
                            node: id.clone(),
                            key: body.template.clone(),
                        })?;
                    let template: NodeTemplate =
                        serde_json::from_str(stored).map_err(|source| CodecError::Decode {
                            what: format!("template {}", body.template),
                            source,
                        })?;
                    let template = Arc::new(template);
                    templates.push((body.template.clone(), template.clone()));
                    self.known.push((template.clone(), body.template.clone()));
                    template
                }
            };
            nodes.push(DurableEntry {
                node: body.node,
                template,
            });
        }
        Ok(Some(DurableState { meta, nodes }))
    }
}

/// The first eight bytes of `digest` as sixteen lowercase hex digits.
fn hex16(digest: &[u8]) -> String {
    hex::encode(&digest[..digest.len().min(8)])
}

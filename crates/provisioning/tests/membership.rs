//! The run's membership as the driver hands it out (design §22, G35): the
//! ready nodes' current attempts, a new version on every change and only
//! then.

mod common;

use common::*;
use provisioning::*;

fn members(membership: &Membership) -> Vec<(String, u64)> {
    membership
        .members
        .iter()
        .map(|m| (m.node.to_string(), m.attempt.get()))
        .collect()
}

fn membership_driver(groups: Vec<NodeGroup>) -> ClusterDriver {
    let mut d = driver();
    d.track_membership();
    d.update_desired(shape(1, groups)).unwrap();
    d
}

#[test]
fn membership_lists_ready_nodes_only_and_bumps_its_version_on_change() {
    let mut d = membership_driver(vec![group("web", 2, "img")]);
    let first = d
        .take_membership()
        .expect("the first take hands out a membership");
    assert_eq!(first.version, 1);
    assert!(first.members.is_empty());
    assert_eq!(first.group_size(&GroupId::new("web")), Some(2));
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(10));
    let ready = d.take_membership().expect("two nodes became ready");
    assert_eq!(ready.version, 2);
    assert_eq!(members(&ready).len(), 2);
    assert!(
        ready
            .members
            .iter()
            .all(|m| m.endpoint.0.starts_with("ep-"))
    );
    assert!(d.take_membership().is_none(), "nothing changed since");
    assert!(!d.membership_pending());
    d.update_desired(shape(2, vec![group("web", 3, "img")]))
        .unwrap();
    assert!(d.membership_pending(), "a group size changed");
    assert_eq!(members(&d.current_membership()), members(&ready));
    assert_eq!(d.take_membership().unwrap().version, 3);
}

#[test]
fn a_lost_node_leaves_the_membership_and_its_replacement_rejoins_it() {
    let mut d = membership_driver(vec![group("web", 2, "img")]);
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(10));
    let before = d.take_membership().unwrap();
    let lost = before.members[0].clone();
    d.apply_observation(
        &Observation::NodeLost {
            node: lost.node.clone(),
            attempt: lost.attempt,
            cause: LossCause::AgentGone,
        },
        at(20),
    )
    .unwrap();
    let after = d.take_membership().expect("a loss changes the membership");
    assert!(after.version > before.version);
    assert!(
        after.members.iter().all(|m| m.attempt != lost.attempt),
        "a lost attempt is never listed: {after:?}"
    );
    assert_eq!(after.members.len(), 1);
    // Cleanup first, then the replacement once its restart delay passed.
    converge(&mut d, &mut sink, at(30));
    converge(&mut d, &mut sink, at(3_600_000));
    let replaced = d.take_membership().expect("the replacement became ready");
    let replacement = replaced
        .members
        .iter()
        .find(|m| m.node == lost.node)
        .expect("the slot is a member again");
    assert!(replacement.attempt > lost.attempt);
    assert_eq!(replacement.node.index(), lost.node.index());
}

#[test]
fn scaling_changes_the_group_size_and_the_members() {
    let mut d = membership_driver(vec![group("web", 2, "img")]);
    let mut sink = RecordingSink::default();
    converge(&mut d, &mut sink, at(10));
    d.take_membership().unwrap();
    d.update_desired(shape(2, vec![group("web", 3, "img")]))
        .unwrap();
    let sized = d.take_membership().expect("the group size changed");
    assert_eq!(sized.group_size(&GroupId::new("web")), Some(3));
    converge(&mut d, &mut sink, at(20));
    let grown = d.take_membership().unwrap();
    assert_eq!(
        members(&grown)
            .iter()
            .map(|m| m.0.clone())
            .collect::<Vec<_>>(),
        ["web-0", "web-1", "web-2"]
    );
    d.update_desired(shape(3, vec![group("web", 1, "img")]))
        .unwrap();
    let shrinking = d.take_membership().unwrap();
    assert_eq!(shrinking.group_size(&GroupId::new("web")), Some(1));
    d.drive_until_blocked(at(30), &mut sink).unwrap();
    let shrunk = d
        .take_membership()
        .expect("nodes being torn down leave at once");
    assert_eq!(
        members(&shrunk)
            .iter()
            .map(|m| m.0.clone())
            .collect::<Vec<_>>(),
        ["web-0"],
        "a node whose teardown was decided is no longer a member"
    );
}

#[test]
fn an_untracked_driver_hands_out_no_membership() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("web", 1, "img")]))
        .unwrap();
    assert!(d.take_membership().is_none());
}

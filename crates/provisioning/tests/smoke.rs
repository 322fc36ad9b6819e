mod common;
use common::*;

#[test]
fn a_two_node_group_converges_with_an_always_successful_provider() {
    let mut d = driver();
    d.update_desired(shape(1, vec![group("g", 2, "img:1")]))
        .unwrap();
    let mut sink = RecordingSink::default();
    let ops = converge(&mut d, &mut sink, at(0));
    assert!(d.is_converged(), "{:#?}", d.state());
    assert_eq!(ops.len(), 8);
    assert_eq!(d.requeue_at(), None);
}

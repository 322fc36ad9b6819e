//! The generic shape file's tests: the document, its groups and limits,
//! and how errors are placed and echoed. Each provider's table is tested in
//! its own module under `crate::providers`.

use super::*;

const GOOD: &str = r#"
run = "demo"

[[group]]
id = "web"
count = 2
[group.boot]
verify_commands = ["true"]
start_command = "sleep 3600"
env = { GREETING = "hello" }

[[group]]
id = "worker"
count = 1
role = "batch"
provider = "process"
[group.shape]
image = "local"
resources = { cpu = 0.5 }
labels = { tier = "back" }
[group.swarm_join]
swarm = "jobs"
"#;

fn parse_text(text: &str) -> Result<ShapeSource, ShapeFileError> {
    parse(Path::new("shape.toml"), text, &providers::kinds())
}

fn check_error(text: &str, expected: &str) {
    let error = parse_text(text).expect_err("the file must be rejected");
    assert_eq!(error.to_string(), expected);
}

#[test]
fn limits_default_to_one_unavailable_and_a_breaker_of_five_and_can_be_set() {
    let source = parse_text(GOOD).unwrap();
    let first = &source.groups[0].id;
    assert_eq!(
        source.limits.max_unavailable[first],
        MaxUnavailable::Count(1)
    );
    assert_eq!(
        source.limits.breakers[first].failures,
        DEFAULT_BREAKER_FAILURES
    );
    assert!(
        source.limits.max_concurrent_creates.is_empty(),
        "no cap for process"
    );
    let text = "run = \"r\"\n[providers.process]\nmax_concurrent_creates = 4\n[[group]]\nid = \"a\"\ncount = 8\nmax_unavailable = \"25%\"\nbreaker_failures = 0\n[[group]]\nid = \"b\"\ncount = 1\nmax_unavailable = 3\nbreaker_cooldown_secs = 9\nbreaker_stable_secs = 0\n";
    let limits = parse_text(text).unwrap().limits;
    assert_eq!(limits.max_concurrent_creates["process"], 4);
    let (a, b) = (GroupId::new("a"), GroupId::new("b"));
    assert_eq!(limits.max_unavailable[&a], MaxUnavailable::Percent(25));
    assert_eq!(limits.max_unavailable[&b], MaxUnavailable::Count(3));
    assert!(!limits.breakers.contains_key(&a), "0 turns the breaker off");
    assert_eq!(
        limits.breakers[&b].cooldown,
        std::time::Duration::from_secs(9)
    );
    assert_eq!(limits.breakers[&b].stable_after, std::time::Duration::ZERO);
    for (bad, field) in [
        ("max_unavailable = 0", "max_unavailable"),
        ("max_unavailable = \"150%\"", "max_unavailable"),
        ("max_unavailable = \"half\"", "max_unavailable"),
        ("breaker_cooldown_secs = 0", "breaker_cooldown_secs"),
    ] {
        let text = format!("run = \"r\"\n[[group]]\nid = \"a\"\ncount = 1\n{bad}\n");
        let error = parse_text(&text).unwrap_err().to_string();
        assert!(error.starts_with("shape.toml:5:"), "{bad}: {error}");
        assert!(
            error.contains(&format!("group[0].{field}")),
            "{bad}: {error}"
        );
    }
}

#[test]
fn a_valid_file_maps_to_groups_of_its_run_with_defaults_filled_in() {
    let source = parse_text(GOOD).unwrap();
    assert_eq!(source.run_id.as_str(), "demo");
    assert_eq!(source.node_count(), 3);
    let web = &source.groups[0];
    assert_eq!(web.id.as_str(), "web");
    assert_eq!(web.run_id.as_str(), "demo");
    assert_eq!(web.template.role, "web", "the role defaults to the id");
    assert_eq!(web.template.provider, providers::DEFAULT_KIND);
    assert_eq!(web.template.swarm_join.swarm, DEFAULT_SWARM);
    assert_eq!(web.template.boot.verify_commands, ["true"]);
    assert_eq!(web.template.boot.start_command, "sleep 3600");
    assert_eq!(web.template.boot.env["GREETING"], "hello");
    let worker = &source.groups[1];
    assert_eq!(worker.template.role, "batch");
    assert_eq!(worker.template.shape.resources["cpu"], 0.5);
    assert_eq!(worker.template.swarm_join.swarm, "jobs");
    assert!(source.desired(Generation::new(1)).is_ok());
}

#[test]
fn an_unknown_field_is_rejected_with_its_line_and_path() {
    let text =
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nstrat_command = \"x\"\n";
    let error = parse_text(text).unwrap_err();
    assert_eq!(error.line, Some(6), "{error}");
    let shown = error.to_string();
    assert!(shown.starts_with("shape.toml:6:"), "{shown}");
    assert!(shown.contains("strat_command"), "{shown}");
    assert!(shown.contains("group[0].boot"), "{shown}");
}

#[test]
fn an_unknown_top_level_field_is_rejected() {
    let error = parse_text("run = \"demo\"\ngeneration = 3\n").unwrap_err();
    assert_eq!(error.line, Some(2), "{error}");
    assert!(error.to_string().contains("generation"), "{error}");
}

#[test]
fn a_wrong_type_is_rejected_naming_the_field() {
    let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = \"three\"\n";
    let error = parse_text(text).unwrap_err();
    assert_eq!(error.line, Some(4), "{error}");
    assert_eq!(error.field.as_deref(), Some("group[0].count"), "{error}");
}

#[test]
fn a_negative_count_is_rejected_naming_the_field() {
    let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = -1\n";
    let error = parse_text(text).unwrap_err();
    assert_eq!(error.line, Some(4), "{error}");
    assert_eq!(error.field.as_deref(), Some("group[0].count"), "{error}");
}

#[test]
fn a_missing_required_field_is_rejected() {
    let error = parse_text("run = \"demo\"\n[[group]]\nid = \"web\"\n").unwrap_err();
    assert!(error.to_string().contains("count"), "{error}");
    let error = parse_text("[[group]]\nid = \"web\"\ncount = 1\n").unwrap_err();
    assert!(error.to_string().contains("run"), "{error}");
}

#[test]
fn invalid_toml_is_rejected_with_its_position() {
    let error = parse_text("run = \"demo\"\n[[group]\n").unwrap_err();
    assert_eq!(error.line, Some(2), "{error}");
}

#[test]
fn a_non_finite_or_negative_resource_is_rejected_at_its_line() {
    check_error(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = { cpu = nan }\n",
        "shape.toml:6:21: field `group[0].shape.resources.cpu`: group \"web\": NaN is not a finite number",
    );
    let error = parse_text(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = { cpu = -2.0 }\n",
    )
    .unwrap_err();
    assert!(error.to_string().contains("is negative"), "{error}");
}

#[test]
fn an_unknown_provider_kind_is_rejected_naming_the_group() {
    check_error(
        "run = \"demo\"\n[[group]]\nid = \"gpu\"\ncount = 1\nprovider = \"cloud\"\n",
        "shape.toml:5:12: field `group[0].provider`: group \"gpu\" names provider kind \"cloud\", which this build does not serve (available: process, exec, ssh, slurm, container, ec2)",
    );
}

#[test]
fn a_group_of_a_provider_whose_table_the_file_lacks_is_told_so() {
    for kind in ["exec", "ssh", "slurm"] {
        check_error(
            &format!("run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\nprovider = \"{kind}\"\n"),
            &format!(
                "shape.toml:5:12: field `group[0].provider`: group \"web\" uses provider \"{kind}\", but the file has no [providers.{kind}] table"
            ),
        );
    }
}

#[test]
fn a_caller_that_serves_fewer_kinds_lists_only_those() {
    let text = "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\nprovider = \"ssh\"\n";
    let error = parse(Path::new("shape.toml"), text, &["process"]).unwrap_err();
    assert_eq!(
        error.to_string(),
        "shape.toml:5:12: field `group[0].provider`: group \"web\" names provider kind \"ssh\", which this build does not serve (available: process)"
    );
}

#[test]
fn a_provider_table_of_an_unknown_kind_is_rejected_naming_the_served_kinds() {
    check_error(
        "run = \"demo\"\n[providers.cloud]\nx = 1\n",
        "shape.toml:2:12: field `providers.cloud`: unknown field `cloud`, expected one of `process`, `exec`, `ssh`, `slurm`, `container`, `ec2`",
    );
}

#[test]
fn an_unknown_group_field_names_the_provider_tables_a_group_may_carry() {
    check_error(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\nstrat = 1\n",
        "shape.toml:5:1: field `group[0].strat`: unknown field `strat`, expected one of `id`, `count`, `role`, `provider`, `shape`, `boot`, `swarm_join`, `max_unavailable`, `breaker_failures`, `breaker_cooldown_secs`, `breaker_stable_secs`, `slurm`, `container`, `ec2`",
    );
}

#[test]
fn core_validation_errors_name_the_file_line_and_group() {
    let duplicate =
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[[group]]\nid = \"web\"\ncount = 2\n";
    let error = parse_text(duplicate).unwrap_err();
    assert_eq!(error.line, Some(6), "{error}");
    assert_eq!(error.field.as_deref(), Some("group[1].id"));
    assert!(
        error.to_string().contains("declared more than once"),
        "{error}"
    );

    let bad_name = "run = \"demo\"\n[[group]]\nid = \"a b\"\ncount = 1\n";
    let error = parse_text(bad_name).unwrap_err();
    assert_eq!(error.line, Some(3), "{error}");
    assert!(error.to_string().contains("invalid group id"), "{error}");

    let bad_run = "run = \"no/slash\"\n";
    let error = parse_text(bad_run).unwrap_err();
    assert_eq!(error.line, Some(1), "{error}");
    assert_eq!(error.field.as_deref(), Some("run"));
}

#[test]
fn environment_names_and_commands_must_be_usable() {
    let error = parse_text(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nenv = { \"A=B\" = \"x\" }\n",
    )
    .unwrap_err();
    assert!(
        error.to_string().contains("environment variable name"),
        "{error}"
    );
    let error = parse_text(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nstart_command = \"a\\u0000b\"\n",
    )
    .unwrap_err();
    assert!(error.to_string().contains("NUL"), "{error}");
}

#[test]
fn a_file_without_groups_is_an_empty_cluster() {
    let source = parse_text("run = \"demo\"\n").unwrap();
    assert!(source.groups.is_empty());
}

/// Every quoted part of `shown` has at most `ECHO_CHARS_MAX` characters.
fn assert_echoes_are_cut(shown: &str, total: usize) {
    // The message around the echoes lists the fields or kinds expected.
    assert!(shown.chars().count() < 600, "{shown}");
    assert!(
        shown.contains(&format!("\u{2026} ({total} characters)")),
        "{shown}"
    );
}

#[test]
fn an_over_long_value_is_echoed_cut_with_its_length() {
    let long = "a".repeat(5000);
    let kept = "a".repeat(ECHO_CHARS_MAX);

    // The core's check of the run name.
    let error = parse_text(&format!("run = \"{long}\"\n")).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "shape.toml:1:7: field `run`: invalid run id \"{kept}\"\u{2026} (5000 characters): longer than 63 characters"
        )
    );

    // The core's check of a group name.
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"{long}\"\ncount = 1\n"
    ))
    .unwrap_err();
    assert_echoes_are_cut(&error.to_string(), 5000);
    assert!(error.to_string().contains("invalid group id"), "{error}");

    // The CLI's own checks, which run before the core's.
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"{long}\"\ncount = 1\nprovider = \"{long}\"\n"
    ))
    .unwrap_err();
    let shown = error.to_string();
    assert_eq!(shown.matches("(5000 characters)").count(), 2, "{shown}");
    assert_echoes_are_cut(&shown, 5000);
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.boot]\nenv = {{ \"{long}=\" = \"x\" }}\n"
    ))
    .unwrap_err();
    assert_echoes_are_cut(&error.to_string(), 5001);
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n[group.shape]\nresources = {{ {long} = -1e300 }}\n"
    ))
    .unwrap_err();
    assert_echoes_are_cut(&error.to_string(), 5000);
    assert!(error.to_string().contains("-1e300 is negative"), "{error}");

    // The parser's messages: a wrong type quotes the value, an unknown
    // field its name (which is also in the field path).
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = \"{long}\"\n"
    ))
    .unwrap_err();
    assert_eq!(error.field.as_deref(), Some("group[0].count"));
    assert_eq!(
        error.message,
        format!(
            "invalid type: string \"{kept}\"\u{2026} (5000 characters); must be a whole number from 0 to 4294967295"
        )
    );
    let error = parse_text(&format!(
        "run = \"demo\"\n[[group]]\nid = \"web\"\ncount = 1\n{long} = 1\n"
    ))
    .unwrap_err();
    let shown = error.to_string();
    assert_eq!(shown.matches("(5000 characters)").count(), 2, "{shown}");
    assert_echoes_are_cut(&shown, 5000);
    assert_eq!(error.line, Some(5), "{error}");
}

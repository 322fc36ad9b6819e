//! `provision conformance --plugin` against the example provider programs
//! in `examples/providers/`, through the real `provision` binary: the
//! reference provider passes the seam contract suite and the battery (8
//! seeds × both modes) with exit 0 and a clean JUnit report, and the broken
//! variant fails both, with the broken contract and the broken guarantee
//! named; the battery's reproduction line reruns the failing case.
//!
//! Needs `python3` on the PATH; without it these tests fail, saying so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The workspace's `examples/providers/` directory.
fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/providers")
}

/// Fails loudly when python3 is missing: the example providers need it.
fn require_python() {
    let found = Command::new("python3")
        .arg("--version")
        .output()
        .map(|out| out.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "python3 is required by the example provider programs and was not found on the PATH"
    );
}

/// Runs `provision conformance --plugin "python3 SCRIPT ARGS" --junit JUNIT`.
fn conformance(script: &str, args: &[&str], junit: &Path) -> (Output, String) {
    conformance_with(script, args, junit, &[], &[])
}

/// [`conformance`] with more `provision` arguments and environment variables.
fn conformance_with(
    script: &str,
    args: &[&str],
    junit: &Path,
    more: &[&str],
    env: &[(&str, &str)],
) -> (Output, String) {
    require_python();
    let mut plugin = format!("python3 {}", examples().join(script).display());
    for arg in args {
        plugin.push(' ');
        plugin.push_str(arg);
    }
    let output = Command::new(env!("CARGO_BIN_EXE_provision"))
        .arg("conformance")
        .arg("--plugin")
        .arg(&plugin)
        .arg("--junit")
        .arg(junit)
        .args(more)
        .envs(env.iter().copied())
        .output()
        .expect("the provision binary runs");
    let text = format!(
        "exit: {:?}\n--- stdout\n{}\n--- stderr\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

/// One element of a parsed XML document.
#[derive(Debug)]
struct Element {
    name: String,
    attributes: BTreeMap<String, String>,
    children: Vec<Element>,
}

impl Element {
    fn all<'a>(&'a self, name: &str, into: &mut Vec<&'a Element>) {
        if self.name == name {
            into.push(self);
        }
        for child in &self.children {
            child.all(name, into);
        }
    }

    fn find(&self, name: &str) -> Vec<&Element> {
        let mut found = Vec::new();
        self.all(name, &mut found);
        found
    }

    fn attribute(&self, name: &str) -> &str {
        self.attributes
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("<{}> has no attribute {name}", self.name))
    }
}

/// A strict parser for the XML subset a JUnit report uses: a declaration,
/// elements with double-quoted attributes, text, the five named entities
/// and numeric character references. Any other input is an error, so a
/// malformed report fails the test.
fn parse_xml(text: &str) -> Result<Element, String> {
    let mut rest = text.trim_start();
    if let Some(after) = rest.strip_prefix("<?xml") {
        let end = after.find("?>").ok_or("an unterminated declaration")?;
        rest = &after[end + 2..];
    }
    let mut stack: Vec<Element> = Vec::new();
    let mut root = None;
    loop {
        let Some(open) = rest.find('<') else {
            if !rest.trim().is_empty() {
                return Err(format!("text outside the root: {rest:?}"));
            }
            break;
        };
        let text_part = &rest[..open];
        check_text(text_part)?;
        if stack.is_empty() && !text_part.trim().is_empty() {
            return Err(format!("text outside the root: {text_part:?}"));
        }
        let close = rest[open..].find('>').ok_or("an unterminated tag")? + open;
        let tag = &rest[open + 1..close];
        rest = &rest[close + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let element = stack
                .pop()
                .ok_or_else(|| format!("</{name}> closes nothing"))?;
            if element.name != name.trim() {
                return Err(format!("</{name}> closes <{}>", element.name));
            }
            attach(&mut stack, &mut root, element)?;
            continue;
        }
        let (body, empty) = match tag.strip_suffix('/') {
            Some(body) => (body, true),
            None => (tag, false),
        };
        let element = parse_tag(body)?;
        if empty {
            attach(&mut stack, &mut root, element)?;
        } else {
            stack.push(element);
        }
    }
    if let Some(open) = stack.last() {
        return Err(format!("<{}> is never closed", open.name));
    }
    root.ok_or_else(|| "no root element".to_owned())
}

fn attach(
    stack: &mut [Element],
    root: &mut Option<Element>,
    element: Element,
) -> Result<(), String> {
    match stack.last_mut() {
        Some(parent) => parent.children.push(element),
        None if root.is_none() => *root = Some(element),
        None => return Err("a second root element".to_owned()),
    }
    Ok(())
}

fn parse_tag(body: &str) -> Result<Element, String> {
    let body = body.trim();
    let name_end = body.find(char::is_whitespace).unwrap_or(body.len());
    let name = &body[..name_end];
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(format!("a bad element name {name:?}"));
    }
    let mut attributes = BTreeMap::new();
    let mut rest = body[name_end..].trim_start();
    while !rest.is_empty() {
        let eq = rest
            .find('=')
            .ok_or_else(|| format!("a bad attribute in <{name}>"))?;
        let key = rest[..eq].trim();
        let value = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or_else(|| format!("an unquoted attribute {key} in <{name}>"))?;
        let end = value
            .find('"')
            .ok_or_else(|| format!("an unterminated attribute {key}"))?;
        check_text(&value[..end])?;
        if attributes
            .insert(key.to_owned(), value[..end].to_owned())
            .is_some()
        {
            return Err(format!("attribute {key} twice in <{name}>"));
        }
        rest = value[end + 1..].trim_start();
    }
    Ok(Element {
        name: name.to_owned(),
        attributes,
        children: Vec::new(),
    })
}

/// Text may hold only known entities and references, and no raw `<` or `"`
/// problems; `>` is allowed by XML.
fn check_text(text: &str) -> Result<(), String> {
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        let after = &rest[amp + 1..];
        let end = after.find(';').ok_or("an unterminated entity")?;
        let entity = &after[..end];
        let known = matches!(entity, "amp" | "lt" | "gt" | "quot" | "apos")
            || entity
                .strip_prefix('#')
                .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if !known {
            return Err(format!("an unknown entity &{entity};"));
        }
        rest = &after[end + 1..];
    }
    if text
        .chars()
        .any(|c| (c as u32) < 0x20 && !matches!(c, '\n' | '\t' | '\r'))
    {
        return Err("a control character XML 1.0 cannot carry".to_owned());
    }
    Ok(())
}

fn read_junit(path: &Path, text: &str) -> Element {
    let xml = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "the JUnit report {} is written ({e}):\n{text}",
            path.display()
        )
    });
    parse_xml(&xml).unwrap_or_else(|e| panic!("the JUnit report parses: {e}\n{xml}"))
}

#[test]
fn the_reference_provider_program_passes_the_whole_suite_with_exit_zero_and_clean_junit() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let root = dir.path().join("machines-root");
    let junit = dir.path().join("report.xml");
    let root_arg = root.display().to_string();
    let (output, text) = conformance("dirs.py", &["--root", &root_arg], &junit);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("0 failed, 0 skipped"), "{text}");
    assert!(
        text.contains("16 trace evaluations") && text.contains("\npassed\n"),
        "the battery ran 8 seeds x 2 modes and passed: {text}"
    );

    let report = read_junit(&junit, &text);
    assert_eq!(report.name, "testsuites");
    let suites = report.find("testsuite");
    assert!(!suites.is_empty(), "no <testsuite> in the report");
    let mut cases = 0;
    for suite in suites {
        assert_eq!(suite.attribute("failures"), "0", "{text}");
        assert_eq!(suite.attribute("errors"), "0", "{text}");
        assert_eq!(suite.attribute("skipped"), "0", "{text}");
        let tests: usize = suite.attribute("tests").parse().expect("tests is a count");
        assert_eq!(tests, suite.find("testcase").len());
        cases += tests;
    }
    assert!(
        cases >= 11,
        "every contract and the battery are test cases, got {cases}"
    );
    let battery: Vec<&Element> = report
        .find("testsuite")
        .into_iter()
        .filter(|suite| suite.attribute("name") == "battery")
        .collect();
    assert_eq!(battery.len(), 1, "one battery suite: {text}");
    assert!(report.find("failure").is_empty(), "{text}");
    assert!(report.find("error").is_empty(), "{text}");
    assert!(report.find("skipped").is_empty(), "{text}");

    // The machines were real directories, and the suite's teardown removed
    // every one of them.
    let machines = root.join("machines");
    let left: Vec<_> = std::fs::read_dir(&machines)
        .expect("the provider made its machines directory")
        .collect();
    assert!(left.is_empty(), "machines left behind: {left:?}");
}

#[test]
fn the_broken_provider_program_that_creates_anew_fails_naming_create_twice_adopts() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let root_arg = dir.path().join("machines-root").display().to_string();
    let junit = dir.path().join("report.xml");
    let (output, text) = conformance("dirs_broken.py", &["--root", &root_arg], &junit);
    let code = output.status.code();
    assert!(
        code.is_some() && code != Some(0),
        "a broken provider must fail the run: {text}"
    );
    assert!(text.contains("FAIL  create-twice-adopts"), "{text}");

    let report = read_junit(&junit, &text);
    let failed: Vec<&str> = report
        .find("testcase")
        .into_iter()
        .filter(|case| !case.find("failure").is_empty())
        .map(|case| case.attribute("name"))
        .collect();
    assert!(failed.contains(&"create-twice-adopts"), "{failed:?}");
    // Only the contracts about adoption on create break.
    assert!(!failed.contains(&"list-is-exact"), "{failed:?}");

    // The battery catches the same defect as a guarantee: two live machines
    // for one attempt.
    assert!(text.contains("G08 no double-create violated"), "{text}");
    assert!(text.contains("battery: FAILED"), "{text}");
    let battery_failures: Vec<&str> = report
        .find("testsuite")
        .into_iter()
        .filter(|suite| suite.attribute("name") == "battery")
        .flat_map(|suite| suite.find("failure"))
        .map(|failure| failure.attribute("message"))
        .collect();
    assert!(
        battery_failures.len() == 1 && battery_failures[0].starts_with("G08"),
        "{battery_failures:?}"
    );
}

#[test]
fn the_battery_reproduction_line_reruns_exactly_the_failing_case_and_seeds_choose_its_size() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let junit = dir.path().join("report.xml");
    // The case the broken provider fails (printed by its failure report).
    let (output, text) = conformance_with(
        "dirs_broken.py",
        &[],
        &junit,
        &[],
        &[
            (
                "PROVISIONING_TRACE",
                "tick 30000ms; run fifo; tick 1000ms; run one 0",
            ),
            ("PROVISIONING_MODE", "adversarial"),
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(text.contains("1 trace evaluations"), "{text}");
    assert!(text.contains("G08 no double-create violated"), "{text}");
    assert!(text.contains("PROVISIONING_TRACE='"), "{text}");
    assert!(text.contains("provision conformance --plugin"), "{text}");

    // The same case against the reference provider passes.
    let (output, text) = conformance_with(
        "dirs.py",
        &[],
        &junit,
        &[],
        &[
            (
                "PROVISIONING_TRACE",
                "tick 30000ms; run fifo; tick 1000ms; run one 0",
            ),
            ("PROVISIONING_MODE", "adversarial"),
        ],
    );
    assert_eq!(output.status.code(), Some(0), "{text}");

    // --seeds sets the battery's size; 0 skips it (and skipping fails nothing).
    let (output, text) = conformance_with("dirs.py", &[], &junit, &["--seeds", "1"], &[]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("2 trace evaluations"), "{text}");
    let (output, text) = conformance_with("dirs.py", &[], &junit, &["--seeds", "0"], &[]);
    assert_eq!(output.status.code(), Some(0), "{text}");
    assert!(text.contains("battery: SKIPPED: --seeds 0"), "{text}");
}

#[test]
fn the_junit_checker_refuses_malformed_documents() {
    for bad in [
        "<a><b></a>",
        "<a x=1/>",
        "<a>&bogus;</a>",
        "<a></a><b/>",
        "<a>",
        "",
        "<a x=\"1\" x=\"2\"/>",
    ] {
        assert!(parse_xml(bad).is_err(), "{bad:?} must not parse");
    }
    let good = parse_xml("<?xml version=\"1.0\"?>\n<a n=\"&lt;1&#10;\"><b/>t &amp; u</a>")
        .expect("a good document parses");
    assert_eq!(good.find("b").len(), 1);
}

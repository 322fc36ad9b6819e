//! What the suite reports: each [`Contract`] with its [`ContractVerdict`]
//! (passed, failed or skipped with a reason) in a [`ContractReport`].

use std::fmt;

/// The promises the suite checks. See the [module docs](self) for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Contract {
    /// A second create for the same attempt adopts without creating.
    CreateTwiceAdopts,
    /// A definite create fault creates nothing.
    DefiniteFaultCreatesNothing,
    /// A definite fault on the creation path never hides a live node.
    DefiniteFaultAdoptsExisting,
    /// An ambiguous create fault may create; the retry adopts.
    AmbiguousFaultRetryAdopts,
    /// A second bootstrap start for the same attempt adopts the session.
    StartTwiceAdopts,
    /// Cancel and destroy of something absent succeed.
    CleanupOfAbsentSucceeds,
    /// Failed cleanup keeps the node (definite) or is retried (ambiguous).
    CleanupFaultsRetry,
    /// `list_nodes` reports exactly the live nodes.
    ListIsExact,
    /// Full teardown leaves nothing.
    TeardownLeavesNothing,
    /// Facts of a superseded attempt are dropped.
    SupersededFactsDropped,
}

impl Contract {
    /// Every contract, in the order the suite runs them.
    pub const ALL: [Contract; 10] = [
        Contract::CreateTwiceAdopts,
        Contract::DefiniteFaultCreatesNothing,
        Contract::DefiniteFaultAdoptsExisting,
        Contract::AmbiguousFaultRetryAdopts,
        Contract::StartTwiceAdopts,
        Contract::CleanupOfAbsentSucceeds,
        Contract::CleanupFaultsRetry,
        Contract::ListIsExact,
        Contract::TeardownLeavesNothing,
        Contract::SupersededFactsDropped,
    ];

    /// The contract's stable name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Contract::CreateTwiceAdopts => "create-twice-adopts",
            Contract::DefiniteFaultCreatesNothing => "definite-fault-creates-nothing",
            Contract::DefiniteFaultAdoptsExisting => "definite-fault-adopts-existing",
            Contract::AmbiguousFaultRetryAdopts => "ambiguous-fault-retry-adopts",
            Contract::StartTwiceAdopts => "start-twice-adopts",
            Contract::CleanupOfAbsentSucceeds => "cleanup-of-absent-succeeds",
            Contract::CleanupFaultsRetry => "cleanup-faults-retry",
            Contract::ListIsExact => "list-is-exact",
            Contract::TeardownLeavesNothing => "teardown-leaves-nothing",
            Contract::SupersededFactsDropped => "superseded-facts-dropped",
        }
    }
}

impl fmt::Display for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What happened to one contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContractVerdict {
    /// The plugin kept the contract.
    Passed,
    /// The plugin broke the contract; the text says how.
    Failed(String),
    /// The contract could not be checked; the text says why.
    Skipped(String),
}

/// The verdict on one contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContractResult {
    /// The contract.
    pub contract: Contract,
    /// Its verdict.
    pub verdict: ContractVerdict,
}

/// What the suite found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContractReport {
    /// The provider kind of the plugin checked (empty when no subject was built).
    pub kind: String,
    /// One result per contract, in [`Contract::ALL`] order.
    pub results: Vec<ContractResult>,
}

impl ContractReport {
    /// The verdict on `contract`.
    pub fn verdict(&self, contract: Contract) -> Option<&ContractVerdict> {
        self.results
            .iter()
            .find(|r| r.contract == contract)
            .map(|r| &r.verdict)
    }

    /// The contracts kept.
    pub fn passed(&self) -> Vec<Contract> {
        self.results
            .iter()
            .filter(|r| r.verdict == ContractVerdict::Passed)
            .map(|r| r.contract)
            .collect()
    }

    /// The contracts broken, with how.
    pub fn failed(&self) -> Vec<(Contract, &str)> {
        self.results
            .iter()
            .filter_map(|r| match &r.verdict {
                ContractVerdict::Failed(why) => Some((r.contract, why.as_str())),
                _ => None,
            })
            .collect()
    }

    /// The contracts not checked, with why.
    pub fn skipped(&self) -> Vec<(Contract, &str)> {
        self.results
            .iter()
            .filter_map(|r| match &r.verdict {
                ContractVerdict::Skipped(why) => Some((r.contract, why.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Whether no contract failed (skipped ones are listed in the report).
    pub fn is_success(&self) -> bool {
        self.failed().is_empty()
    }

    /// Panics with the whole report when a contract failed.
    ///
    /// # Panics
    /// When [`ContractReport::is_success`] is false.
    #[track_caller]
    pub fn assert_passed(&self) {
        assert!(
            self.is_success(),
            "the plugin breaks the seam contract:\n{self}"
        );
    }
}

impl fmt::Display for ContractReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seam contract suite for provider {:?}: {} passed, {} failed, {} skipped",
            self.kind,
            self.passed().len(),
            self.failed().len(),
            self.skipped().len()
        )?;
        for result in &self.results {
            match &result.verdict {
                ContractVerdict::Passed => writeln!(f, "  pass  {}", result.contract)?,
                ContractVerdict::Failed(why) => {
                    writeln!(f, "  FAIL  {}: {why}", result.contract)?;
                }
                ContractVerdict::Skipped(why) => {
                    writeln!(f, "  skip  {}: {why}", result.contract)?;
                }
            }
        }
        Ok(())
    }
}

//! [`FakeLayoutIo`]: a recording [`LayoutIo`] for tests (`test-util`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_core::model::IpFamily;
use kp_nftnl::layout::{Forget, Readback};
use kp_nftnl::monitor::Quiet;
use kp_rules::nftables::TABLE;
use kp_rules::nftables::layout::class::ClassObject;
use kp_rules::nftables::layout::{Changes, Element};

use super::LayoutIo;
use super::io::PROGRAM;
use crate::exec::ExecError;

/// One call seen by [`FakeLayoutIo`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayoutCall {
    /// `nft -f -` with this text.
    Script(String),
    /// An element transaction.
    Elements {
        /// The family.
        family: IpFamily,
        /// Deleted.
        delete: Vec<Element>,
        /// Added.
        add: Vec<Element>,
    },
    /// Classes and elements in one netlink transaction.
    Classes {
        /// The family.
        family: IpFamily,
        /// The classes' objects, as `nft -f` statements.
        statements: Vec<String>,
        /// Deleted.
        delete: Vec<Element>,
        /// Added.
        add: Vec<Element>,
    },
    /// A read-back.
    Read(IpFamily),
    /// The notification watch taken out of its group.
    Quiet,
    /// Clients of removed endpoints forgotten: the pins swept.
    Forget(Vec<Forget>),
}

#[derive(Debug, Default)]
struct FakeState {
    calls: Vec<LayoutCall>,
    /// Elements per family, as element transactions left them.
    elements: BTreeMap<IpFamily, BTreeSet<Element>>,
    /// What a read-back returns, per family (`None`: no table).
    tables: BTreeMap<IpFamily, Readback>,
    fail_elements: usize,
    fail_scripts: usize,
    /// Moved by every transaction, as the kernel's.
    generation: u32,
    /// Another program's deletion of this element, committed during the next quiet load.
    during_quiet: Option<(IpFamily, Element)>,
    quiet: bool,
}

/// A recording [`LayoutIo`]: scripts are recorded (and, when they create or delete the
/// table, make it exist or not), element transactions change its element sets, read-backs
/// return those with the chains a test set. Clones share the record.
#[derive(Clone, Debug, Default)]
pub struct FakeLayoutIo {
    state: Arc<Mutex<FakeState>>,
}

impl FakeLayoutIo {
    /// An empty kernel.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<LayoutCall> {
        self.lock().calls.clone()
    }

    /// Forget the calls so far.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// The elements `family`'s table holds.
    pub fn elements(&self, family: IpFamily) -> BTreeSet<Element> {
        self.lock()
            .elements
            .get(&family)
            .cloned()
            .unwrap_or_default()
    }

    /// Make `family`'s table exist with `back` (chains and sets; its elements are replaced
    /// by what element transactions write from now on).
    pub fn set_table(&self, family: IpFamily, back: Readback) {
        let mut state = self.lock();
        state
            .elements
            .insert(family, back.elements.iter().cloned().collect());
        state.tables.insert(family, back);
    }

    /// Another program changes `family`'s elements.
    pub fn tamper(&self, family: IpFamily, f: impl FnOnce(&mut BTreeSet<Element>)) {
        let mut state = self.lock();
        state.generation = state.generation.wrapping_add(1);
        f(state.elements.entry(family).or_default());
    }

    /// Another program deletes `element` from `family`'s table while the next quiet load
    /// runs (before its first transaction), when nobody hears of it.
    pub fn delete_during_quiet(&self, family: IpFamily, element: Element) {
        self.lock().during_quiet = Some((family, element));
    }

    /// Fail the next `n` netlink transactions (elements, or classes; nothing of them
    /// applied).
    pub fn fail_elements(&self, n: usize) {
        self.lock().fail_elements = n;
    }

    /// Fail the next `n` scripts.
    pub fn fail_scripts(&self, n: usize) {
        self.lock().fail_scripts = n;
    }
}

fn fake_failure(program: &str) -> ExecError {
    ExecError::Failed {
        program: program.to_owned(),
        code: Some(1),
        stderr: "Error: injected by the test".to_owned(),
    }
}

impl FakeLayoutIo {
    /// One netlink transaction recorded as `call`: applied to the elements unless a
    /// failure was asked for.
    fn transaction(
        &self,
        family: IpFamily,
        call: LayoutCall,
        delete: &[Element],
        add: &[Element],
    ) -> Result<(), ExecError> {
        let mut state = self.lock();
        if state.quiet
            && let Some((theirs, element)) = state.during_quiet.take()
        {
            state.generation = state.generation.wrapping_add(1);
            let key = element.key();
            state
                .elements
                .entry(theirs)
                .or_default()
                .retain(|e| e.key() != key);
        }
        state.calls.push(call);
        if state.fail_elements > 0 {
            state.fail_elements -= 1;
            return Err(fake_failure(PROGRAM));
        }
        state.generation = state.generation.wrapping_add(1);
        let set = state.elements.entry(family).or_default();
        for element in delete {
            let key = element.key();
            set.retain(|e| e.key() != key);
        }
        set.extend(add.iter().cloned());
        Ok(())
    }
}

impl LayoutIo for FakeLayoutIo {
    async fn apply_script(&self, script: &str) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.calls.push(LayoutCall::Script(script.to_owned()));
        if state.fail_scripts > 0 {
            state.fail_scripts -= 1;
            return Err(fake_failure("nft"));
        }
        state.generation = state.generation.wrapping_add(1);
        for family in [IpFamily::V4, IpFamily::V6] {
            let fam = super::super::table_family(family);
            let table = format!("table {fam} {TABLE}\n");
            if script.contains(&format!("delete {table}")) {
                state.tables.remove(&family);
                state.elements.remove(&family);
            }
            if script.contains(&format!("add chain {fam} {TABLE} dispatch")) {
                let back = state.tables.entry(family).or_default();
                for chain in ["dispatch", "pick"] {
                    if !back.chains.iter().any(|c| c == chain) {
                        back.chains.push(chain.to_owned());
                    }
                }
            }
        }
        Ok(())
    }

    fn apply_elements(
        &self,
        family: IpFamily,
        delete: &[Element],
        add: &[Element],
    ) -> Result<(), ExecError> {
        let call = LayoutCall::Elements {
            family,
            delete: delete.to_vec(),
            add: add.to_vec(),
        };
        self.transaction(family, call, delete, add)
    }

    fn apply_classes(
        &self,
        family: IpFamily,
        classes: &[ClassObject],
        changes: &Changes,
    ) -> Result<(), ExecError> {
        let call = LayoutCall::Classes {
            family,
            statements: classes.iter().map(|o| o.statement(family)).collect(),
            delete: changes.delete.clone(),
            add: changes.add.clone(),
        };
        self.transaction(family, call, &changes.delete, &changes.add)
    }

    fn read_table(&self, family: IpFamily) -> Result<Option<Readback>, ExecError> {
        let mut state = self.lock();
        state.calls.push(LayoutCall::Read(family));
        let elements: Vec<Element> = state
            .elements
            .get(&family)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default();
        Ok(state.tables.get(&family).cloned().map(|mut back| {
            back.elements = elements;
            back
        }))
    }

    fn chains(&self, family: IpFamily) -> Result<Option<Vec<String>>, ExecError> {
        Ok(self.lock().tables.get(&family).map(|b| b.chains.clone()))
    }

    fn generation(&self) -> Result<u32, ExecError> {
        let mut state = self.lock();
        // The watch rejoined by the time the generation is read after a quiet load.
        state.quiet = false;
        Ok(state.generation)
    }

    fn quiet(&self) -> Quiet {
        let mut state = self.lock();
        state.calls.push(LayoutCall::Quiet);
        state.quiet = true;
        Quiet::default()
    }

    fn forget_clients(&self, _family: IpFamily, pins: &[Forget]) -> Result<usize, ExecError> {
        self.lock().calls.push(LayoutCall::Forget(pins.to_vec()));
        Ok(0)
    }
}

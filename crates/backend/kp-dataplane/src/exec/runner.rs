//! [`RuleRunner`], the three operations iptables mode needs (restore, save, one `iptables`
//! call), and [`ExecRunner`], which runs them with the real tools: restores with
//! `--noflush` under the xtables lock, streamed from the render on the calling thread, or
//! in a throwaway network namespace (`unshare --net`) to find which service breaks one.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use kp_core::model::IpFamily;
use kp_rules::iptables::Table;

use super::process::{run_program, stream_program};
use super::text::split_save;
use super::{ExecError, IptablesVariant, Tools};
use crate::blocking::blocking;

/// How long to wait for the xtables lock (`-w`). Upstream waits 5 s; another agent holding
/// the lock longer than that is stuck, and failing lets the runner retry with a full sync.
pub const DEFAULT_LOCK_WAIT_SECONDS: u32 = 5;

/// The three operations iptables mode needs. Implementations must be safe to share between
/// tasks; each call is independent.
pub trait RuleRunner: Send + Sync {
    /// Apply `input` atomically with `iptables-restore --noflush` (or `ip6tables-restore`).
    fn restore(
        &self,
        family: IpFamily,
        input: &str,
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// Apply `input` with `iptables-restore` in a new, empty network namespace that is then
    /// thrown away: everything the kernel checks when a restore commits is checked, and
    /// nothing on the node changes. Used to find which service breaks a restore whose error
    /// names no line of its own.
    fn restore_isolated(
        &self,
        family: IpFamily,
        input: &str,
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// [`RuleRunner::restore`] or [`RuleRunner::restore_isolated`] (`into`) of the input
    /// `feed` writes, which it may write in pieces as it produces them so that the whole
    /// input never has to exist at once (`kp_rules::iptables::render_to`). The default
    /// collects it and calls the other method; [`ExecRunner`] pipes it to the tool as it
    /// comes.
    fn restore_from<F>(
        &self,
        family: IpFamily,
        into: RestoreInto,
        feed: F,
    ) -> impl Future<Output = Result<(), ExecError>> + Send
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()> + Send,
    {
        async move {
            let mut input = Vec::new();
            feed(&mut input).map_err(|source| ExecError::Io {
                program: "restore input".to_owned(),
                source,
            })?;
            let input = String::from_utf8_lossy(&input);
            match into {
                RestoreInto::Node => self.restore(family, &input).await,
                RestoreInto::EmptyNamespace => self.restore_isolated(family, &input).await,
            }
        }
    }

    /// The output of `iptables-save -t <table>`.
    fn save(
        &self,
        family: IpFamily,
        table: Table,
    ) -> impl Future<Output = Result<String, ExecError>> + Send;

    /// The output of `iptables-save -t <table>` for each of `tables`: one run per table
    /// unless the runner reads them together ([`ExecRunner`] runs `iptables-save` once for
    /// all of them, where every run costs a process start and a read of the ruleset).
    fn save_tables(
        &self,
        family: IpFamily,
        tables: &[Table],
    ) -> impl Future<Output = Result<BTreeMap<Table, String>, ExecError>> + Send {
        async move {
            let mut saved = BTreeMap::new();
            for table in tables {
                saved.insert(*table, self.save(family, *table).await?);
            }
            Ok(saved)
        }
    }

    /// One `iptables` call (`-t nat -N CHAIN`, `-C ...`, `-I ... 1 ...`). Exit code 1 is an
    /// [`ExecError::Failed`] like any other; callers interpret it (rule or chain absent or
    /// present).
    fn run(
        &self,
        family: IpFamily,
        args: &[String],
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// The backend the tools belong to, for sync logs (`None`: not a real one, e.g. a fake).
    fn variant(&self) -> Option<IptablesVariant> {
        None
    }
}

/// Where [`RuleRunner::restore_from`] applies its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreInto {
    /// This node's namespace, as [`RuleRunner::restore`].
    Node,
    /// A new, empty network namespace, as [`RuleRunner::restore_isolated`].
    EmptyNamespace,
}

/// util-linux's `unshare`, on the `PATH`: runs a restore in a network namespace of its own
/// ([`RuleRunner::restore_isolated`]); needs the `CAP_SYS_ADMIN` a kube-proxy pod has.
pub const UNSHARE_BINARY: &str = "unshare";

/// Runs the real tools with `tokio::process`.
#[derive(Clone, Debug, Default)]
pub struct ExecRunner {
    tools: Tools,
}

impl ExecRunner {
    /// A runner for `tools`.
    pub fn new(tools: Tools) -> Self {
        Self { tools }
    }

    /// The tools it runs.
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// `iptables --version`, for the start-up log (see
    /// [`backend_of_version`](super::backend_of_version)).
    pub async fn version(&self) -> Result<String, ExecError> {
        let program = &self.tools.iptables;
        let output = run_program(program, &["--version".to_owned()], None).await?;
        Ok(output.trim().to_owned())
    }
}

impl ExecRunner {
    /// The program and arguments of a restore `into`.
    fn restore_command(&self, family: IpFamily, into: RestoreInto) -> (PathBuf, Vec<String>) {
        let restore = vec![
            "--noflush".to_owned(),
            format!("--wait={DEFAULT_LOCK_WAIT_SECONDS}"),
        ];
        match into {
            RestoreInto::Node => (self.tools.restore(family).clone(), restore),
            RestoreInto::EmptyNamespace => {
                let mut args = vec![
                    "--net".to_owned(),
                    "--".to_owned(),
                    self.tools.restore(family).display().to_string(),
                ];
                args.extend(restore);
                (PathBuf::from(UNSHARE_BINARY), args)
            }
        }
    }
}

impl RuleRunner for ExecRunner {
    async fn restore(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let (program, args) = self.restore_command(family, RestoreInto::Node);
        run_program(&program, &args, Some(input)).await?;
        Ok(())
    }

    async fn restore_isolated(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let (program, args) = self.restore_command(family, RestoreInto::EmptyNamespace);
        run_program(&program, &args, Some(input))
            .await
            .map_err(unshare_failure)?;
        Ok(())
    }

    /// The tool reads the input while `feed` produces it. `feed` is synchronous (a render),
    /// so this runs on the calling thread, handed over as a blocking section
    /// (`block_in_place`) on a multi-threaded runtime so the worker's other tasks move on.
    async fn restore_from<F>(
        &self,
        family: IpFamily,
        into: RestoreInto,
        feed: F,
    ) -> Result<(), ExecError>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()> + Send,
    {
        let (program, args) = self.restore_command(family, into);
        let result = blocking(|| stream_program(&program, &args, feed));
        match into {
            RestoreInto::Node => result,
            RestoreInto::EmptyNamespace => result.map_err(unshare_failure),
        }
    }

    async fn save(&self, family: IpFamily, table: Table) -> Result<String, ExecError> {
        let args = ["-t".to_owned(), table.as_str().to_owned()];
        run_program(self.tools.save(family), &args, None).await
    }

    /// One `iptables-save` of every table, cut into the ones asked for (a table the kernel
    /// does not have reads as empty, as `-t` of it prints nothing).
    async fn save_tables(
        &self,
        family: IpFamily,
        tables: &[Table],
    ) -> Result<BTreeMap<Table, String>, ExecError> {
        if tables.len() < 2 {
            let mut saved = BTreeMap::new();
            for table in tables {
                saved.insert(*table, self.save(family, *table).await?);
            }
            return Ok(saved);
        }
        let all = run_program(self.tools.save(family), &[], None).await?;
        Ok(split_save(&all, tables))
    }

    async fn run(&self, family: IpFamily, args: &[String]) -> Result<(), ExecError> {
        let mut full = vec!["-w".to_owned(), DEFAULT_LOCK_WAIT_SECONDS.to_string()];
        full.extend_from_slice(args);
        run_program(self.tools.iptables(family), &full, None).await?;
        Ok(())
    }

    fn variant(&self) -> Option<IptablesVariant> {
        Some(self.tools.variant)
    }
}

/// `unshare` itself failing (no `CAP_SYS_ADMIN` in an unprivileged container: "unshare:
/// unshare failed: Operation not permitted") exits 1 like a failing restore. It must not be
/// taken for the restore's verdict, or the search for a bad service would blame good ones;
/// it becomes [`ExecError::Spawn`] (the restore could not be run at all).
pub(super) fn unshare_failure(error: ExecError) -> ExecError {
    match error {
        ExecError::Failed { stderr, .. } if stderr.starts_with("unshare:") => ExecError::Spawn {
            program: UNSHARE_BINARY.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, stderr),
        },
        other => other,
    }
}

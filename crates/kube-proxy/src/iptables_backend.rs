//! Choosing the host's iptables backend once at start-up (`kp_dataplane::xtables`); the host
//! probe keeps the choice ([`crate::modes::Host::iptables`]) and every mode runs that
//! backend's tools. Precedence: `--iptables-backend`, then `$KUBE_PROXY_RS_IPTABLES_BACKEND`, then
//! `iptablesBackend` in the configuration file; `auto` in any of them detects.

use anyhow::Context as _;
use kp_config::IptablesBackend;
use kp_dataplane::exec::{IptablesVariant, Tools};
use kp_dataplane::xtables::{self, BACKEND_ENV, Choice, ExecProbe};

/// Where the operator chose a backend, if anywhere: the first of the flag, the environment
/// variable and the file that is not `auto`. `flag` is `--iptables-backend` as given; `file`
/// is the configuration's value (which the flag, when given, has already overwritten).
pub fn configured(
    flag: Option<IptablesBackend>,
    env: Option<&str>,
    file: IptablesBackend,
) -> anyhow::Result<Option<(String, IptablesVariant)>> {
    let env = env
        .map(|value| {
            value
                .parse::<IptablesBackend>()
                .map_err(|e| anyhow::anyhow!("${BACKEND_ENV}={value:?}: {e}"))
        })
        .transpose()?;
    // The flag decides even when it says `auto`: it overrides the variable and the file.
    let (source, backend) = match (flag, env) {
        (Some(flag), _) => ("--iptables-backend".to_owned(), flag),
        (None, Some(env)) => (format!("${BACKEND_ENV}"), env),
        (None, None) => ("iptablesBackend in the configuration".to_owned(), file),
    };
    Ok(match backend {
        IptablesBackend::Auto => None,
        IptablesBackend::Legacy => Some((source, IptablesVariant::Legacy)),
        IptablesBackend::Nft => Some((source, IptablesVariant::Nft)),
    })
}

/// Decides the backend (detecting it unless configured) and logs it once with the reason. Called through the host probe ([`crate::modes::host`]).
pub async fn select(
    flag: Option<IptablesBackend>,
    file: IptablesBackend,
) -> anyhow::Result<Choice> {
    let env = std::env::var(BACKEND_ENV).ok();
    let configured =
        configured(flag, env.as_deref(), file).context("choosing the iptables backend")?;
    let choice = xtables::choose(configured, &ExecProbe).await;
    let tools = Tools::new(choice.variant);
    tracing::info!(
        backend = xtables::variant_name(choice.variant),
        restore = %tools.iptables_restore.display(),
        reason = %choice.reason,
        "Using iptables backend"
    );
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_then_environment_then_file() {
        let file = IptablesBackend::Nft;
        let chosen = |flag, env| configured(flag, env, file).expect("valid");
        assert_eq!(
            chosen(Some(IptablesBackend::Legacy), Some("nft")),
            Some(("--iptables-backend".to_owned(), IptablesVariant::Legacy))
        );
        assert_eq!(
            chosen(None, Some("legacy")),
            Some((format!("${BACKEND_ENV}"), IptablesVariant::Legacy))
        );
        assert_eq!(
            chosen(None, None),
            Some((
                "iptablesBackend in the configuration".to_owned(),
                IptablesVariant::Nft
            ))
        );
        // `auto` given explicitly still overrides what comes after it.
        assert_eq!(chosen(Some(IptablesBackend::Auto), Some("legacy")), None);
        assert_eq!(chosen(None, Some("auto")), None);
        assert_eq!(
            configured(None, None, IptablesBackend::Auto).expect("valid"),
            None
        );
        let err = configured(None, Some("xtables"), file).expect_err("invalid");
        assert!(err.to_string().contains(BACKEND_ENV), "{err}");
    }
}

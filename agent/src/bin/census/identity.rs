//! `census identity list | get <id> | lookup <labels>`: identities from the operator.

use std::time::SystemTime;

use census_proto::pb;
use clap::Subcommand;
use serde::Serialize;

use super::{
    Ctx,
    args::{parse_identity, parse_labels, parse_selector},
    error::CliError,
    output::{Table, ago, from_millis, nonzero, until},
};

#[derive(Debug, Subcommand)]
pub(crate) enum IdentityCommand {
    /// Every identity, in id order.
    List {
        /// Only identities carrying all these labels (`k8s:app=web,k8s:tier=db`; repeatable).
        #[arg(long, value_name = "SELECTOR")]
        labels: Vec<String>,
        /// Also list quarantined ids (deleted, not yet bound again).
        #[arg(long)]
        include_quarantined: bool,
    },
    /// One identity by its number.
    Get {
        /// The identity, a number.
        id: String,
    },
    /// The identity of exactly this label set (after the operator's label filter).
    Lookup {
        /// Labels, `source:key=value`, separated by spaces or commas.
        #[arg(required = true, value_name = "LABELS")]
        labels: Vec<String>,
    },
}

/// One identity, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct IdentityView {
    pub(crate) id: u32,
    /// Canonical labels, sorted; empty for a quarantined id.
    pub(crate) labels: Vec<String>,
    /// `live`, `protected`, `released`, `deleting`, `quarantined`, `creating`,
    /// `reserved`, `blocked` (or `unknown`).
    pub(crate) state: &'static str,
    /// Endpoints (over all nodes) whose view maps to it.
    pub(crate) references: u64,
    /// Nodes holding it from a recent allocation.
    pub(crate) holds: u32,
    /// When it was released (ms since the Unix epoch), for `released`.
    pub(crate) released_at_ms: Option<u64>,
    /// When its quarantine ends (ms since the Unix epoch), for `quarantined`.
    pub(crate) quarantined_until_ms: Option<u64>,
    /// The earliest end of the operator's restart fence (ms since the Unix epoch),
    /// for `protected`.
    pub(crate) protected_until_ms: Option<u64>,
}

impl From<pb::Identity> for IdentityView {
    fn from(identity: pb::Identity) -> Self {
        let pb::Identity {
            id,
            labels,
            state,
            references,
            holds,
            released_at_ms,
            quarantined_until_ms,
            protected_until_ms,
        } = identity;
        use pb::IdentityState as S;
        let state = match S::try_from(state) {
            Ok(S::Live) => "live",
            Ok(S::Protected) => "protected",
            Ok(S::Released) => "released",
            Ok(S::Deleting) => "deleting",
            Ok(S::Quarantined) => "quarantined",
            Ok(S::Creating) => "creating",
            Ok(S::Reserved) => "reserved",
            Ok(S::Blocked) => "blocked",
            Ok(S::Unspecified) | Err(_) => "unknown",
        };
        Self {
            id,
            labels,
            state,
            references,
            holds,
            released_at_ms: nonzero(released_at_ms),
            quarantined_until_ms: nonzero(quarantined_until_ms),
            protected_until_ms: nonzero(protected_until_ms),
        }
    }
}

impl IdentityView {
    /// The state for people: `released 45s ago`, `quarantined for 9m15s`.
    fn state_cell(&self, now: SystemTime) -> String {
        match (self.state, self.released_at_ms, self.quarantined_until_ms) {
            ("released", Some(since), _) => {
                format!("released {}", ago(now, since))
            }
            ("quarantined", _, Some(end)) => format!("quarantined for {}", until(now, end)),
            // The fence may stand past its earliest end: then there is no time to show.
            ("protected", _, _) => match self.protected_until_ms {
                Some(end) if from_millis(end) > now => format!("protected for {}", until(now, end)),
                _ => "protected".to_owned(),
            },
            (state, _, _) => state.to_owned(),
        }
    }
}

pub(crate) async fn run(command: IdentityCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    match command {
        IdentityCommand::List {
            labels,
            include_quarantined,
        } => {
            let selector = parse_selector(&labels)?;
            let operator = ctx.operator().await?;
            let identities: Vec<IdentityView> = operator
                .list_identities(selector, include_quarantined)
                .await?
                .into_iter()
                .map(IdentityView::from)
                .collect();
            ctx.render(&identities, || table(&identities, ctx.now))
        }
        IdentityCommand::Get { id } => {
            let id = parse_identity(&id)?;
            let operator = ctx.operator().await?;
            let identity =
                operator
                    .get_identity(id)
                    .await?
                    .ok_or_else(|| CliError::UnknownIdentity {
                        id,
                        addr: operator.addr().clone(),
                    })?;
            let view = IdentityView::from(identity);
            ctx.render(&view, || table(std::slice::from_ref(&view), ctx.now))
        }
        IdentityCommand::Lookup { labels } => {
            let labels = parse_labels(&labels)?;
            let operator = ctx.operator().await?;
            let identity =
                operator
                    .lookup(labels.clone())
                    .await?
                    .ok_or_else(|| CliError::UnknownLabels {
                        labels: labels.join(","),
                        addr: operator.addr().clone(),
                    })?;
            let view = IdentityView::from(identity);
            ctx.render(&view, || table(std::slice::from_ref(&view), ctx.now))
        }
    }
}

fn table(identities: &[IdentityView], now: SystemTime) -> Table {
    let mut table = Table::new(["ID", "STATE", "REFS", "HOLDS", "LABELS"]);
    for identity in identities {
        table.row(vec![
            identity.id.to_string(),
            identity.state_cell(now),
            identity.references.to_string(),
            identity.holds.to_string(),
            identity.labels.join(","),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    const NOW_MS: u64 = 1_700_000_000_000;

    fn fixture() -> Vec<IdentityView> {
        let identity = |id, labels: &[&str], state: pb::IdentityState, refs, released, until| {
            IdentityView::from(pb::Identity {
                id,
                labels: labels.iter().map(|l| (*l).to_owned()).collect(),
                state: state.into(),
                references: refs,
                holds: 0,
                released_at_ms: released,
                quarantined_until_ms: until,
                protected_until_ms: 0,
            })
        };
        vec![
            identity(1, &["reserved:host="], pb::IdentityState::Reserved, 0, 0, 0),
            identity(
                256,
                &["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"],
                pb::IdentityState::Live,
                3,
                0,
                0,
            ),
            identity(
                257,
                &["k8s:app=db"],
                pb::IdentityState::Released,
                0,
                NOW_MS - 45_000,
                0,
            ),
            identity(258, &["k8s:app=old"], pb::IdentityState::Deleting, 0, 0, 0),
            identity(
                259,
                &[],
                pb::IdentityState::Quarantined,
                0,
                0,
                NOW_MS + 555_000,
            ),
            IdentityView::from(pb::Identity {
                id: 260,
                labels: vec!["k8s:app=cart".into()],
                state: pb::IdentityState::Protected.into(),
                protected_until_ms: NOW_MS + 75_000,
                ..pb::Identity::default()
            }),
        ]
    }

    #[test]
    fn table_shows_states_for_people() -> Result<(), CliError> {
        let identities = fixture();
        let out = render(Format::Table, false, &identities, || {
            table(&identities, from_millis(NOW_MS))
        })?;
        assert_eq!(
            out,
            "\
ID   STATE                  REFS  HOLDS  LABELS
1    reserved               0     0      reserved:host=
256  live                   3     0      k8s:app=web,k8s:io.kubernetes.pod.namespace=shop
257  released 45s ago       0     0      k8s:app=db
258  deleting               0     0      k8s:app=old
259  quarantined for 9m15s  0     0
260  protected for 1m15s    0     0      k8s:app=cart
"
        );
        Ok(())
    }

    #[test]
    fn json_is_stable() -> Result<(), CliError> {
        let identities = fixture();
        let json = render(Format::Json, false, &identities[1..3], || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "id": 256,
    "labels": [
      "k8s:app=web",
      "k8s:io.kubernetes.pod.namespace=shop"
    ],
    "state": "live",
    "references": 3,
    "holds": 0,
    "released_at_ms": null,
    "quarantined_until_ms": null,
    "protected_until_ms": null
  },
  {
    "id": 257,
    "labels": [
      "k8s:app=db"
    ],
    "state": "released",
    "references": 0,
    "holds": 0,
    "released_at_ms": 1699999955000,
    "quarantined_until_ms": null,
    "protected_until_ms": null
  }
]
"#
        );
        Ok(())
    }

    #[test]
    fn yaml_of_one() -> Result<(), CliError> {
        let identity = &fixture()[4];
        let yaml = render(Format::Yaml, false, identity, || unreachable!())?;
        assert_eq!(
            yaml,
            "\
id: 259
labels: []
state: quarantined
references: 0
holds: 0
released_at_ms: null
quarantined_until_ms: 1700000555000
protected_until_ms: null
"
        );
        Ok(())
    }
}

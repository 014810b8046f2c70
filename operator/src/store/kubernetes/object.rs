//! Identity objects as census reads them, leniently: any object becomes a [`Parsed`]
//! value (an invalid one says what is wrong with it), so one malformed object never
//! fails a list or a watch. Only an object whose name is not an id cannot be keyed.

use census_proto::{
    domain::IdentityId,
    labels::{LabelLimits, LabelSet},
};
use kube::api::{ApiResource, DynamicObject};
use serde::Deserialize;
use serde_json::{Value, json};

use super::crd::{
    IdentitySpec, IdentityStatus, TombstoneStatus, hash_from_text, hash_to_text, time_from_text,
    time_to_text,
};
use crate::store::Tombstone;

/// What an object says about its id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    /// A live binding to this canonical label set.
    Binding(LabelSet),
    /// A deleted binding, quarantined until `until_ms`.
    Tombstone {
        /// The labels the id had, if the spec still holds a valid set.
        labels: Option<LabelSet>,
        labels_hash: u64,
        until_ms: u64,
    },
    /// Census cannot use this object; the text says why.
    Invalid(Box<str>),
}

/// The version of an object census needs for preconditions, and its age for choosing
/// between two objects that claim one label set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Meta {
    pub(crate) uid: Box<str>,
    pub(crate) resource_version: Box<str>,
    /// `creationTimestamp` in ms; objects without one sort last.
    pub(crate) created_ms: i64,
    /// `deletionTimestamp` is set: the object is being deleted and stays only until
    /// its finalizers are removed (someone else's: census sets none). It is neither a
    /// binding nor a tombstone census can rely on, and nothing can be created under
    /// its name until it is gone.
    pub(crate) deleting: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) id: IdentityId,
    pub(crate) meta: Meta,
    pub(crate) state: State,
}

/// An Identity object whose name is not a numeric id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Identity object {name:?}: the name must be a numeric identity id")]
pub(crate) struct BadName {
    pub(crate) name: String,
}

/// Reads one object.
pub(crate) fn parse(obj: &DynamicObject, limits: &LabelLimits) -> Result<Parsed, BadName> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let id = name
        .parse::<u32>()
        .ok()
        .filter(|n| n.to_string() == name)
        .and_then(IdentityId::new)
        .ok_or_else(|| BadName { name: name.clone() })?;
    let meta = Meta {
        uid: obj.metadata.uid.clone().unwrap_or_default().into(),
        resource_version: obj
            .metadata
            .resource_version
            .clone()
            .unwrap_or_default()
            .into(),
        created_ms: obj
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(i64::MAX, |t| t.0.as_millisecond()),
        deleting: obj.metadata.deletion_timestamp.is_some(),
    };
    let state = state_of(&obj.data, limits).unwrap_or_else(|why| State::Invalid(why.into()));
    Ok(Parsed { id, meta, state })
}

fn state_of(data: &Value, limits: &LabelLimits) -> Result<State, String> {
    let labels = labels_of(data, limits);
    let status = match data.get("status") {
        None | Some(Value::Null) => IdentityStatus::default(),
        Some(v) => IdentityStatus::deserialize(v).map_err(|e| format!("status: {e}"))?,
    };
    match status.tombstone {
        None => labels.map(State::Binding),
        Some(TombstoneStatus { labels_hash, until }) => {
            let hash = hash_from_text(&labels_hash).ok_or_else(|| {
                format!("status.tombstone.labelsHash: {labels_hash:?} is not 16 hex digits")
            })?;
            let until_ms = time_from_text(&until).ok_or_else(|| {
                format!("status.tombstone.until: {until:?} is not an RFC 3339 time")
            })?;
            Ok(State::Tombstone {
                labels: labels.ok(),
                labels_hash: hash,
                until_ms,
            })
        }
    }
}

fn labels_of(data: &Value, limits: &LabelLimits) -> Result<LabelSet, String> {
    let spec = data.get("spec").ok_or("spec: missing")?;
    let spec = IdentitySpec::deserialize(spec).map_err(|e| format!("spec: {e}"))?;
    let set = LabelSet::parse_indexed(&spec.labels, limits).map_err(|(i, e)| match i {
        Some(i) => format!("spec.labels[{i}]: {e}"),
        None => format!("spec.labels: {e}"),
    })?;
    if set.to_strings() != spec.labels {
        return Err(format!(
            "spec.labels: not a canonical label set (sorted, without duplicates): expected {:?}",
            set.to_strings()
        ));
    }
    Ok(set)
}

/// A new binding object.
pub(crate) fn binding(resource: &ApiResource, id: IdentityId, labels: &LabelSet) -> DynamicObject {
    DynamicObject::new(&id.to_string(), resource).data(json!({
        "spec": {"labels": labels.to_strings()},
    }))
}

/// The `/status` merge patch that turns the binding at `resource_version` into a tombstone.
pub(crate) fn tombstone_patch(resource_version: &str, tombstone: &Tombstone) -> Value {
    json!({
        "metadata": {"resourceVersion": resource_version},
        "status": {
            "state": "Quarantined",
            "tombstone": {
                "labelsHash": hash_to_text(tombstone.labels_hash),
                "until": time_to_text(tombstone.until_ms),
            },
        },
    })
}

/// The `/status` merge patch that makes the tombstone at `resource_version` a binding again.
pub(crate) fn revive_patch(resource_version: &str) -> Value {
    json!({
        "metadata": {"resourceVersion": resource_version},
        "status": null,
    })
}

/// The `ApiResource` of the Identity CRD, for a dynamic API.
pub(crate) fn api_resource() -> ApiResource {
    ApiResource::erase::<super::crd::Identity>(&())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(name: &str, data: Value) -> DynamicObject {
        let mut o = DynamicObject::new(name, &api_resource()).data(data);
        o.metadata.uid = Some("u1".into());
        o.metadata.resource_version = Some("7".into());
        o
    }

    fn limits() -> LabelLimits {
        LabelLimits::default()
    }

    #[test]
    fn reads_bindings_and_tombstones() -> Result<(), Box<dyn std::error::Error>> {
        let labels: LabelSet = "k8s:app=web,k8s:tier=db".parse()?;
        let p = parse(
            &obj("300", json!({"spec": {"labels": labels.to_strings()}})),
            &limits(),
        )?;
        assert_eq!(p.state, State::Binding(labels.clone()));
        assert_eq!(&*p.meta.resource_version, "7");
        assert!(!p.meta.deleting);
        let tomb = Tombstone {
            id: p.id,
            labels_hash: labels.stable_hash(),
            until_ms: 1_795_000_000_000,
        };
        let mut data = json!({"spec": {"labels": labels.to_strings()}});
        data["status"] = tombstone_patch("7", &tomb)["status"].clone();
        let p = parse(&obj("300", data), &limits())?;
        assert_eq!(
            p.state,
            State::Tombstone {
                labels: Some(labels),
                labels_hash: tomb.labels_hash,
                until_ms: tomb.until_ms,
            }
        );
        Ok(())
    }

    #[test]
    fn a_deletion_timestamp_marks_an_object_being_deleted() -> Result<(), Box<dyn std::error::Error>>
    {
        let labels: LabelSet = "k8s:app=web".parse()?;
        let mut o = obj("300", json!({"spec": {"labels": labels.to_strings()}}));
        o.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        o.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ));
        let p = parse(&o, &limits())?;
        assert!(p.meta.deleting);
        assert_eq!(p.state, State::Binding(labels));
        Ok(())
    }

    #[test]
    fn malformed_objects_are_invalid_not_errors() -> Result<(), Box<dyn std::error::Error>> {
        let cases = [
            (json!({}), "spec: missing"),
            (json!({"spec": {"labels": 5}}), "spec: invalid type"),
            (json!({"spec": {"labels": ["k8s:-x=y"]}}), "spec.labels[0]"),
            (
                json!({"spec": {"labels": ["k8s:b=1", "k8s:a=1"]}}),
                "not a canonical label set",
            ),
            (
                json!({"spec": {"labels": ["k8s:a=1"]}, "status": {"tombstone": {"labelsHash": "x", "until": "now"}}}),
                "labelsHash",
            ),
            (
                json!({"spec": {"labels": ["k8s:a=1"]}, "status": "broken"}),
                "status:",
            ),
        ];
        for (data, needle) in cases {
            let p = parse(&obj("301", data.clone()), &limits())?;
            match p.state {
                State::Invalid(why) => assert!(why.contains(needle), "{data}: {why}"),
                other => panic!("{data}: expected invalid, got {other:?}"),
            }
        }
        for name in ["web", "0", "0300", "4294967296", ""] {
            assert!(parse(&obj(name, json!({})), &limits()).is_err(), "{name}");
        }
        Ok(())
    }
}

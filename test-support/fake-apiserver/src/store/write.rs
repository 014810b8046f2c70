//! The API's writes: create, update, patch, delete.

use std::sync::Arc;

use serde_json::{Value, json};

use super::*;

impl Store {
    /// What the server fills in on create, per resource.
    fn prepare_create(&mut self, res: usize, obj: &mut Value) {
        let spec = self.spec(res).clone();
        let map = match obj.as_object_mut() {
            Some(m) => m,
            None => return,
        };
        if spec.status_subresource {
            match (spec.group.as_str(), spec.plural.as_str()) {
                ("", "nodes") => {}
                ("", "pods") => {
                    map.insert("status".into(), json!({"phase": "Pending"}));
                }
                ("", "namespaces") => {
                    map.insert("status".into(), json!({"phase": "Active"}));
                }
                (CRD_GROUP, CRD_PLURAL) => {
                    let names = map
                        .get("spec")
                        .and_then(|s| s.get("names"))
                        .cloned()
                        .unwrap_or(Value::Null);
                    let stored: Vec<Value> = map
                        .get("spec")
                        .and_then(|s| s.get("versions"))
                        .and_then(Value::as_array)
                        .map(|vs| {
                            vs.iter()
                                .filter(|v| v["storage"].as_bool() == Some(true))
                                .map(|v| v["name"].clone())
                                .collect()
                        })
                        .unwrap_or_default();
                    let now = object::now();
                    map.insert(
                        "status".into(),
                        json!({
                            "acceptedNames": names,
                            "storedVersions": stored,
                            "conditions": [
                                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                                 "message": "no conflicts found", "lastTransitionTime": now},
                                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                                 "message": "the initial names have been accepted", "lastTransitionTime": now},
                            ],
                        }),
                    );
                }
                _ => {
                    map.remove("status");
                }
            }
        }
    }

    pub(super) fn fill_new_meta(&mut self, res: usize, obj: &mut Value, keep_given: bool) {
        let spec = self.spec(res).clone();
        if let Some(map) = obj.as_object_mut() {
            map.insert("apiVersion".into(), Value::String(spec.api_version()));
            map.insert("kind".into(), Value::String(spec.kind));
        }
        if !(keep_given && meta_str(obj, "uid").is_some()) {
            let uid = self.rng.uuid();
            set_meta(obj, "uid", Value::String(uid));
        }
        if !(keep_given && meta_str(obj, "creationTimestamp").is_some()) {
            set_meta(obj, "creationTimestamp", Value::String(object::now()));
        }
        if !(keep_given && object::generation(obj) > 0) {
            set_meta(obj, "generation", json!(1));
        }
    }

    /// Resolve `metadata.name`/`generateName` to a free name.
    pub(super) fn pick_name(
        &mut self,
        res: usize,
        namespace: &str,
        obj: &mut Value,
    ) -> Result<String, ApiError> {
        if let Some(name) = meta_str(obj, "name") {
            return Ok(name.to_owned());
        }
        let Some(prefix) = meta_str(obj, "generateName").map(str::to_owned) else {
            return Err(self.invalid(res, "", Invalidity::NameRequired));
        };
        // As the API server checks a prefix: a trailing `-` is allowed, the rest must
        // be a name (found against a real API server: the fake took any prefix).
        let masked = match prefix.strip_suffix('-') {
            Some(head) => format!("{head}a"),
            None => prefix.clone(),
        };
        if !object::valid_name(&masked) {
            return Err(self.invalid(res, "", Invalidity::BadGenerateName(prefix)));
        }
        let mut name = format!("{prefix}{}", self.rng.name_suffix());
        for _ in 0..8 {
            if !self.resources[res]
                .objects
                .contains_key(&ObjKey::new(namespace, &name))
            {
                break;
            }
            name = format!("{prefix}{}", self.rng.name_suffix());
        }
        set_meta(obj, "name", Value::String(name.clone()));
        Ok(name)
    }

    pub(super) fn namespace_exists(&self, namespace: &str) -> bool {
        self.resolve(&Gvr::new("", "v1", "namespaces"))
            .is_some_and(|ns| {
                self.resources[ns]
                    .objects
                    .contains_key(&ObjKey::new("", namespace))
            })
    }

    /// POST: create, as the API does (the namespace must exist).
    pub(crate) fn create(
        &mut self,
        res: usize,
        namespace: &str,
        mut obj: Value,
    ) -> Result<Obj, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::NotAnObject);
        }
        let spec = self.spec(res).clone();
        if meta_str(&obj, "resourceVersion").is_some() {
            return Err(ApiError::ResourceVersionOnCreate);
        }
        if spec.namespaced {
            match meta_str(&obj, "namespace") {
                Some(ns) if ns != namespace => return Err(ApiError::NamespaceMismatch),
                _ => set_meta(&mut obj, "namespace", Value::String(namespace.to_owned())),
            }
            if !self.namespace_exists(namespace) {
                return Err(ApiError::NotFound {
                    resource: resource::GroupResource {
                        group: String::new(),
                        resource: "namespaces".into(),
                    },
                    name: namespace.to_owned(),
                });
            }
        } else {
            remove_meta(&mut obj, "namespace");
        }
        let name = self.pick_name(res, namespace, &mut obj)?;
        if !object::valid_name(&name) {
            return Err(self.invalid(res, &name, Invalidity::BadName(name.clone())));
        }
        if let Some((key, value)) = object::bad_label_value(&obj) {
            return Err(self.invalid(res, &name, Invalidity::BadLabelValue { key, value }));
        }
        // Validation comes before storage: an invalid Event is 422 even if its name is taken.
        crate::events::validate_create(&spec, namespace, &obj)
            .map_err(|cause| self.invalid(res, &name, cause))?;
        let key = ObjKey::new(if spec.namespaced { namespace } else { "" }, &name);
        if self.resources[res].objects.contains_key(&key) {
            return Err(ApiError::AlreadyExists {
                resource: spec.group_resource(),
                name,
            });
        }
        remove_meta(&mut obj, "deletionTimestamp");
        remove_meta(&mut obj, "deletionGracePeriodSeconds");
        self.fill_new_meta(res, &mut obj, false);
        self.prepare_create(res, &mut obj);
        self.admit(res, &key, Sub::Main, None, Some(&obj))?;
        let obj = self.commit_put(res, key, obj, None);
        self.after_put(res, &obj);
        Ok(obj)
    }

    /// Refuses an update whose body names another version, name or namespace than
    /// the object's, or carries a label value that is not one.
    fn check_update(
        &self,
        res: usize,
        key: &ObjKey,
        old_rv: &str,
        new: &Value,
        spec: &ResourceSpec,
    ) -> Result<(), ApiError> {
        if let Some(rv) = meta_str(new, "resourceVersion")
            && rv != old_rv
        {
            return Err(self.conflict(res, &key.name, ConflictCause::Modified));
        }
        if let Some(name) = meta_str(new, "name")
            && name != key.name
        {
            return Err(ApiError::NameMismatch {
                body: name.to_owned(),
                url: key.name.clone(),
            });
        }
        if spec.namespaced
            && let Some(ns) = meta_str(new, "namespace")
            && ns != key.namespace
        {
            return Err(ApiError::NamespaceMismatch);
        }
        if let Some((label, value)) = object::bad_label_value(new) {
            return Err(self.invalid(
                res,
                &key.name,
                Invalidity::BadLabelValue { key: label, value },
            ));
        }
        Ok(())
    }

    /// The update path shared by PUT and PATCH once the new body is known.
    fn update_object(
        &mut self,
        res: usize,
        key: &ObjKey,
        old: &Obj,
        new: Value,
        sub: Sub,
    ) -> Result<Obj, ApiError> {
        if !new.is_object() {
            return Err(ApiError::NotAnObject);
        }
        let spec = self.spec(res).clone();
        let old_rv = meta_str(old, "resourceVersion")
            .unwrap_or_default()
            .to_owned();
        self.check_update(res, key, &old_rv, &new, &spec)?;
        let mut next = match sub {
            Sub::Status => status_update(old, &new),
            Sub::Main => main_update(old, new, &spec, key),
        };
        set_meta(&mut next, "resourceVersion", Value::String(old_rv));

        let deleting = meta_str(old, "deletionTimestamp").is_some();
        if deleting {
            let before = object::finalizers(old);
            if object::finalizers(&next)
                .iter()
                .any(|f| !before.contains(f))
            {
                return Err(self.invalid(res, &key.name, Invalidity::FinalizerWhileDeleting));
            }
        }
        self.admit(res, key, sub, Some(old), Some(&next))?;
        if next == **old {
            // The real server skips writes that change nothing: no new version.
            return Ok(Arc::clone(old));
        }
        // `ShouldDeleteDuringUpdate`: the last finalizer gone from an object whose
        // deletion is not waiting for a grace period (a terminating pod stays
        // until its kubelet confirms).
        let grace_pending = object::meta(old)
            .and_then(|m| m.get("deletionGracePeriodSeconds"))
            .and_then(Value::as_i64)
            .is_some_and(|g| g > 0);
        if deleting && !grace_pending && object::finalizers(&next).is_empty() {
            if let Some(m) = object::meta_mut(&mut next) {
                m.remove("finalizers");
            }
            return Ok(self.commit_delete(res, key, next));
        }
        let obj = self.commit_put(res, key.clone(), next, Some(Arc::clone(old)));
        self.after_put(res, &obj);
        Ok(obj)
    }

    /// PUT.
    pub(crate) fn update(
        &mut self,
        res: usize,
        key: &ObjKey,
        new: Value,
        sub: Sub,
    ) -> Result<Obj, ApiError> {
        // The handler checks the name before storage is consulted.
        if let Some(name) = meta_str(&new, "name")
            && name != key.name
        {
            return Err(ApiError::NameMismatch {
                body: name.to_owned(),
                url: key.name.clone(),
            });
        }
        let old = self.get(res, key)?;
        self.update_object(res, key, &old, new, sub)
    }

    /// PATCH; returns the object and whether it was created (apply only).
    pub(crate) fn patch(
        &mut self,
        res: usize,
        key: &ObjKey,
        kind: PatchKind,
        patch: &Value,
        sub: Sub,
    ) -> Result<(Obj, bool), ApiError> {
        let old = match self.get(res, key) {
            Ok(old) => old,
            Err(not_found) => {
                if kind != PatchKind::Apply || sub != Sub::Main {
                    return Err(not_found);
                }
                let mut body = patch.clone();
                if !body.is_object() {
                    return Err(ApiError::NotAnObject);
                }
                if meta_str(&body, "name").is_none() {
                    set_meta(&mut body, "name", Value::String(key.name.clone()));
                }
                return self.create(res, &key.namespace, body).map(|o| (o, true));
            }
        };
        if kind == PatchKind::Strategic && !self.resources[res].builtin {
            // Custom resources have no strategic-merge schema.
            return Err(ApiError::UnsupportedPatch {
                content_type: "application/strategic-merge-patch+json".into(),
            });
        }
        let mut doc = (*old).clone();
        match kind {
            PatchKind::Merge | PatchKind::Strategic => patch::merge(&mut doc, patch),
            PatchKind::Apply => {
                if !patch.is_object() {
                    return Err(patch::PatchError::NotAnObject.into());
                }
                patch::merge(&mut doc, patch);
            }
            PatchKind::Json => patch::json_patch(&mut doc, patch)?,
        }
        self.update_object(res, key, &old, doc, sub)
            .map(|o| (o, false))
    }

    /// DELETE, with the request's `gracePeriodSeconds` (graceful for pods only).
    pub(crate) fn delete(
        &mut self,
        res: usize,
        key: &ObjKey,
        pre: &Preconditions,
    ) -> Result<DeleteOutcome, ApiError> {
        let old = self.get(res, key)?;
        if let Some(uid) = &pre.uid {
            let actual = meta_str(&old, "uid").unwrap_or_default();
            if uid != actual {
                return Err(self.conflict(
                    res,
                    &key.name,
                    ConflictCause::UidPrecondition {
                        expected: uid.clone(),
                        actual: actual.to_owned(),
                    },
                ));
            }
        }
        if let Some(rv) = &pre.resource_version {
            let actual = meta_str(&old, "resourceVersion").unwrap_or_default();
            if rv != actual {
                return Err(self.conflict(
                    res,
                    &key.name,
                    ConflictCause::ResourceVersionPrecondition {
                        expected: rv.clone(),
                        actual: actual.to_owned(),
                    },
                ));
            }
        }
        self.admit(res, key, Sub::Main, Some(&old), None)?;
        if self.is_pods(res)
            && let graceful::GracefulOutcome::Terminating(obj) =
                self.delete_pod_gracefully(res, key, pre.grace_period_seconds)?
        {
            return Ok(DeleteOutcome::Pending(obj));
        }
        if object::finalizers(&old).is_empty() {
            let last = (*old).clone();
            return Ok(DeleteOutcome::Gone(self.commit_delete(res, key, last)));
        }
        if meta_str(&old, "deletionTimestamp").is_some() {
            return Ok(DeleteOutcome::Pending(old));
        }
        let mut next = (*old).clone();
        set_meta(&mut next, "deletionTimestamp", Value::String(object::now()));
        set_meta(&mut next, "deletionGracePeriodSeconds", json!(0));
        set_meta(&mut next, "generation", json!(object::generation(&old) + 1));
        Ok(DeleteOutcome::Pending(self.commit_put(
            res,
            key.clone(),
            next,
            Some(old),
        )))
    }

    /// DELETE on a collection: every matching object, as individual deletes.
    pub(crate) fn delete_collection(
        &mut self,
        res: usize,
        namespace: Option<&str>,
        label: &LabelSelector,
        field: &FieldSelector,
    ) -> Vec<Obj> {
        let spec = self.spec(res).clone();
        let keys: Vec<ObjKey> = self.resources[res]
            .objects
            .iter()
            .filter(|(k, o)| {
                namespace.is_none_or(|ns| k.namespace == ns) && matches(&spec, label, field, o)
            })
            .map(|(k, _)| k.clone())
            .collect();
        keys.iter()
            .filter_map(|k| match self.delete(res, k, &Preconditions::default()) {
                Ok(DeleteOutcome::Gone(o) | DeleteOutcome::Pending(o)) => Some(o),
                Err(_) => None,
            })
            .collect()
    }
}

/// A status update: `old` with `new`'s status (none if it has none).
fn status_update(old: &Obj, new: &Value) -> Value {
    let mut next = (**old).clone();
    if let Some(map) = next.as_object_mut() {
        match new.get("status") {
            Some(status) => map.insert("status".into(), status.clone()),
            None => map.remove("status"),
        };
    }
    next
}

/// An update of the object itself: `new`, with what the client cannot change kept
/// from `old` (its status, where that is a subresource, and the server-set
/// metadata), the name and namespace the URL's, and `generation` bumped when the
/// spec changed.
fn main_update(old: &Obj, new: Value, spec: &ResourceSpec, key: &ObjKey) -> Value {
    let mut next = new;
    if spec.status_subresource
        && let Some(map) = next.as_object_mut()
    {
        match old.get("status") {
            Some(status) => map.insert("status".into(), status.clone()),
            None => map.remove("status"),
        };
    }
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "generation",
    ] {
        match object::meta(old).and_then(|m| m.get(field)) {
            Some(v) => set_meta(&mut next, field, v.clone()),
            None => remove_meta(&mut next, field),
        }
    }
    set_meta(&mut next, "name", Value::String(key.name.clone()));
    if spec.namespaced {
        set_meta(&mut next, "namespace", Value::String(key.namespace.clone()));
    } else {
        remove_meta(&mut next, "namespace");
    }
    if let Some(map) = next.as_object_mut() {
        map.insert("apiVersion".into(), Value::String(spec.api_version()));
        map.insert("kind".into(), Value::String(spec.kind.clone()));
    }
    if object::spec_differs(old, &next, spec.status_subresource) {
        set_meta(&mut next, "generation", json!(object::generation(old) + 1));
    }
    next
}

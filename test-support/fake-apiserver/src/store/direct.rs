//! Direct access for tests: seeding and edits behind the clients' backs.

use serde_json::{Value, json};

use super::*;

impl Store {
    /// Create or replace an object as given (status included), bypassing
    /// the API's create rules; its namespace is created if missing.
    pub(crate) fn seed(&mut self, mut obj: Value) -> Result<Obj, Error> {
        let (Some(api_version), Some(kind)) = (obj["apiVersion"].as_str(), obj["kind"].as_str())
        else {
            return Err(Error::MissingTypeMeta);
        };
        let res = self
            .resolve_kind(api_version, kind)
            .ok_or_else(|| Error::UnknownKind {
                api_version: api_version.to_owned(),
                kind: kind.to_owned(),
            })?;
        let spec = self.spec(res).clone();
        let namespace = if spec.namespaced {
            let ns = meta_str(&obj, "namespace").unwrap_or("default").to_owned();
            set_meta(&mut obj, "namespace", Value::String(ns.clone()));
            if !self.namespace_exists(&ns)
                && let Some(nsres) = self.resolve(&Gvr::new("", "v1", "namespaces"))
            {
                let mut ns_obj = json!({"metadata": {"name": ns}, "status": {"phase": "Active"}});
                self.fill_new_meta(nsres, &mut ns_obj, false);
                self.commit_put(nsres, ObjKey::new("", &ns), ns_obj, None);
            }
            ns
        } else {
            remove_meta(&mut obj, "namespace");
            String::new()
        };
        let name = self.pick_name(res, &namespace, &mut obj)?;
        let key = ObjKey::new(&namespace, &name);
        let prev = self.resources[res].objects.get(&key).cloned();
        match &prev {
            Some(old) => {
                for field in ["uid", "creationTimestamp"] {
                    if meta_str(&obj, field).is_none()
                        && let Some(v) = object::meta(old).and_then(|m| m.get(field))
                    {
                        set_meta(&mut obj, field, v.clone());
                    }
                }
                if object::generation(&obj) == 0 {
                    let bump = i64::from(object::spec_differs(old, &obj, spec.status_subresource));
                    set_meta(
                        &mut obj,
                        "generation",
                        json!(object::generation(old) + bump),
                    );
                }
            }
            None => self.fill_new_meta(res, &mut obj, true),
        }
        let obj = self.commit_put(res, key, obj, prev);
        self.after_put(res, &obj);
        Ok(obj)
    }

    /// Remove an object at once, finalizers or not.
    pub(crate) fn remove(&mut self, res: usize, key: &ObjKey) -> Option<Obj> {
        let last = (**self.resources[res].objects.get(key)?).clone();
        Some(self.commit_delete(res, key, last))
    }

    /// Edit an object behind every client's back (a new resourceVersion).
    pub(crate) fn modify(
        &mut self,
        res: usize,
        key: &ObjKey,
        edit: impl FnOnce(&mut Value),
    ) -> Result<Obj, ApiError> {
        let old = self.get(res, key)?;
        let mut next = (*old).clone();
        edit(&mut next);
        if let Some(map) = object::meta_mut(&mut next) {
            map.insert("name".into(), Value::String(key.name.clone()));
        }
        let obj = self.commit_put(res, key.clone(), next, Some(old));
        self.after_put(res, &obj);
        Ok(obj)
    }

    /// Set an annotation behind every client's back.
    pub(crate) fn annotate(
        &mut self,
        res: usize,
        key: &ObjKey,
        name: &str,
        value: &str,
    ) -> Result<Obj, ApiError> {
        self.modify(res, key, |obj| {
            if let Some(meta) = object::meta_mut(obj) {
                let annotations = meta
                    .entry("annotations")
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Some(a) = annotations.as_object_mut() {
                    a.insert(name.to_owned(), Value::String(value.to_owned()));
                } else {
                    *annotations = json!({ name: value });
                }
            }
        })
    }
}

//! Validation and admission of API writes: the CRD schema and its CEL rules
//! (custom resources), then the ValidatingAdmissionPolicies.

use std::{collections::HashMap, sync::Arc};

use serde_json::Value;

use super::*;
use crate::{
    admission::{self, Attributes, Operation, Tokens, UserInfo},
    validation::CrdValidation,
};

/// The store's admission state: who the current request is from, the
/// accepted tokens, and each custom resource's compiled validation (by the
/// resourceVersion of its CRD object).
#[derive(Debug)]
pub(crate) struct AdmissionState {
    pub(crate) caller: UserInfo,
    pub(crate) tokens: Tokens,
    compiled: HashMap<usize, (String, Option<Arc<CrdValidation>>)>,
}

impl Default for AdmissionState {
    fn default() -> Self {
        Self {
            caller: UserInfo::anonymous(),
            tokens: Tokens::default(),
            compiled: HashMap::new(),
        }
    }
}

use crate::resource::VAP_GROUP;

impl Store {
    /// The compiled validation of a custom resource's served version.
    fn crd_validation(&mut self, res: usize) -> Option<Arc<CrdValidation>> {
        if self.resources[res].builtin {
            return None;
        }
        let spec = self.spec(res).clone();
        let crds = self.resolve(&Gvr::new(CRD_GROUP, "v1", CRD_PLURAL))?;
        let crd = self.resources[crds]
            .objects
            .get(&ObjKey::new("", &format!("{}.{}", spec.plural, spec.group)))?
            .clone();
        let rv = meta_str(&crd, "resourceVersion")
            .unwrap_or_default()
            .to_owned();
        if let Some((seen, compiled)) = self.admission.compiled.get(&res)
            && *seen == rv
        {
            return compiled.clone();
        }
        let compiled = CrdValidation::from_crd(&crd, &spec.version).map(Arc::new);
        self.admission.compiled.insert(res, (rv, compiled.clone()));
        compiled
    }

    fn objects_of(&self, resource: &str) -> Vec<Obj> {
        self.resolve(&Gvr::new(VAP_GROUP, "v1", resource))
            .map(|r| self.all(r))
            .unwrap_or_default()
    }

    /// Validate and admit a write; `new` is None for a delete, `old` for a create.
    pub(super) fn admit(
        &mut self,
        res: usize,
        key: &ObjKey,
        sub: Sub,
        old: Option<&Value>,
        new: Option<&Value>,
    ) -> Result<(), ApiError> {
        let operation = match (old, new) {
            (None, _) => Operation::Create,
            (Some(_), Some(_)) => Operation::Update,
            (Some(_), None) => Operation::Delete,
        };
        if let Some(obj) = new
            && let Some(validation) = self.crd_validation(res)
        {
            let causes = validation.validate(obj, old);
            if !causes.is_empty() {
                let spec = self.spec(res);
                return Err(ApiError::FieldsInvalid {
                    kind: spec.kind.clone(),
                    group: spec.group.clone(),
                    name: key.name.clone(),
                    causes,
                });
            }
        }
        let bindings = self.objects_of("validatingadmissionpolicybindings");
        if bindings.is_empty() {
            return Ok(());
        }
        let policies = self.objects_of("validatingadmissionpolicies");
        let spec = self.spec(res).clone();
        let attributes = Attributes {
            operation,
            spec: &spec,
            subresource: match sub {
                Sub::Main => None,
                Sub::Status => Some("status"),
            },
            namespace: &key.namespace,
            name: &key.name,
            object: new,
            old_object: old,
            user: &self.admission.caller,
        };
        let policies: Vec<&Value> = policies.iter().map(|p| &**p).collect();
        let bindings: Vec<&Value> = bindings.iter().map(|b| &**b).collect();
        admission::check(&policies, &bindings, &attributes)
    }
}

//! URL and query parsing: which endpoint a request addresses, and its verb.

use http::Method;

use crate::{log::Verb, resource::Gvr};

/// A resource URL: `/api/v1[/namespaces/{ns}]/{resource}[/{name}[/{sub}]]`
/// or the same under `/apis/{group}/{version}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ResourcePath {
    pub(crate) gvr: Gvr,
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
    /// The deprecated `/watch/` path prefix was used.
    pub(crate) watch_prefix: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Version,
    Health,
    /// `/api`.
    CoreVersions,
    /// `/apis`.
    Groups,
    /// `/apis/{group}`.
    Group(String),
    /// `/api/v1` or `/apis/{group}/{version}`.
    GroupVersion(String, String),
    Resource(ResourcePath),
    /// `/openapi/v3`.
    OpenApiRoot,
    /// `/openapi/v3/{api/v1 | apis/group/version}`.
    OpenApiGroupVersion(String),
    Unknown,
}

fn resource_path(group: &str, version: &str, rest: &[&str]) -> Route {
    let (watch_prefix, rest) = match rest.split_first() {
        Some((&"watch", tail)) => (true, tail),
        _ => (false, rest),
    };
    let (namespace, rest): (Option<String>, Vec<&str>) = match rest {
        ["namespaces", ns, resource, tail @ ..] if !matches!(*resource, "status" | "finalize") => (
            Some((*ns).to_owned()),
            std::iter::once(*resource)
                .chain(tail.iter().copied())
                .collect(),
        ),
        _ => (None, rest.to_vec()),
    };
    let owned = |s: &&str| (*s).to_owned();
    match rest.as_slice() {
        [resource, more @ ..] if more.len() <= 2 => Route::Resource(ResourcePath {
            gvr: Gvr::new(group, version, resource),
            namespace,
            name: more.first().map(owned),
            subresource: more.get(1).map(owned),
            watch_prefix,
        }),
        _ => Route::Unknown,
    }
}

pub(crate) fn parse(path: &str) -> Route {
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match parts.as_slice() {
        ["version"] => Route::Version,
        ["healthz" | "livez" | "readyz", ..] => Route::Health,
        ["api"] => Route::CoreVersions,
        ["api", version] => Route::GroupVersion(String::new(), (*version).to_owned()),
        ["api", version, rest @ ..] => resource_path("", version, rest),
        ["apis"] => Route::Groups,
        ["apis", group] => Route::Group((*group).to_owned()),
        ["apis", group, version] => Route::GroupVersion((*group).to_owned(), (*version).to_owned()),
        ["apis", group, version, rest @ ..] => resource_path(group, version, rest),
        ["openapi", "v3"] => Route::OpenApiRoot,
        ["openapi", "v3", rest @ ..] => Route::OpenApiGroupVersion(rest.join("/")),
        _ => Route::Unknown,
    }
}

/// Whether a `watch` query value turns a list into a watch.
pub(crate) fn is_watch(value: Option<&str>) -> bool {
    matches!(value, Some("true" | "1" | "True"))
}

pub(crate) fn verb(method: &Method, route: &Route, watch: bool) -> Verb {
    let Route::Resource(p) = route else {
        return match route {
            Route::Unknown => Verb::Other,
            _ => Verb::Discovery,
        };
    };
    let named = p.name.is_some();
    match (method.as_str(), named) {
        ("GET", true) if p.watch_prefix => Verb::Watch,
        ("GET", true) => Verb::Get,
        ("GET", false) if watch || p.watch_prefix => Verb::Watch,
        ("GET", false) => Verb::List,
        ("POST", false) => Verb::Create,
        ("PUT", true) => Verb::Update,
        ("PATCH", true) => Verb::Patch,
        ("DELETE", true) => Verb::Delete,
        ("DELETE", false) => Verb::DeleteCollection,
        _ => Verb::Other,
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `application/x-www-form-urlencoded` query pairs, empty pairs skipped.
pub(crate) fn parse_query(query: Option<&str>) -> Vec<(String, String)> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_resource_paths() {
        let r = parse("/api/v1/namespaces/ns/pods/p/status");
        let Route::Resource(p) = r else {
            panic!("not a resource: {r:?}");
        };
        assert_eq!(p.gvr, Gvr::new("", "v1", "pods"));
        assert_eq!(p.namespace.as_deref(), Some("ns"));
        assert_eq!(p.name.as_deref(), Some("p"));
        assert_eq!(p.subresource.as_deref(), Some("status"));

        let r = parse("/api/v1/namespaces/ns");
        assert!(
            matches!(&r, Route::Resource(p) if p.gvr.resource == "namespaces" && p.name.as_deref() == Some("ns"))
        );
        let r = parse("/api/v1/namespaces/ns/status");
        assert!(
            matches!(&r, Route::Resource(p) if p.subresource.as_deref() == Some("status") && p.namespace.is_none())
        );
        let r = parse("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases");
        assert!(
            matches!(&r, Route::Resource(p) if p.gvr.group == "coordination.k8s.io" && p.name.is_none())
        );
        assert_eq!(parse("/apis/g"), Route::Group("g".into()));
        assert_eq!(parse("/api/v1/a/b/c/d"), Route::Unknown);
    }

    #[test]
    fn decodes_queries() {
        let q = parse_query(Some(
            "&watch=true&fieldSelector=spec.nodeName%3Dn1&labelSelector=a+in+(x)",
        ));
        assert_eq!(
            q,
            vec![
                ("watch".to_owned(), "true".to_owned()),
                ("fieldSelector".to_owned(), "spec.nodeName=n1".to_owned()),
                ("labelSelector".to_owned(), "a in (x)".to_owned()),
            ]
        );
    }
}

//! HTTP handlers: one fallback handler routes every request, applies faults,
//! serves it from the store and logs it.

use std::{sync::Arc, time::Instant};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    response::Response,
};
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use serde::Serialize;
use serde_json::{Value, json};

use crate::{
    error::{ApiError, Invalidity},
    log::{ListSource, RequestRecord, Verb},
    object,
    patch::PatchKind,
    resource::{Discovery, ResourceSpec},
    route::{self, ResourcePath, Route},
    selector::{FieldSelector, LabelSelector},
    server::Shared,
    store::{DeleteOutcome, ListQuery, Obj, ObjKey, Preconditions, ReadVersion, Sub, WatchFrom},
    watch::{self, WatchRequest},
};

const MAX_BODY: usize = 64 << 20;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

/// The request's query and headers, as the handlers need them.
struct Ctx<'a> {
    shared: &'a Arc<Shared>,
    query: &'a [(String, String)],
    metadata_only: bool,
    aggregated: bool,
    content_type: String,
    /// Who sent the request (`admission`).
    user: crate::admission::UserInfo,
}

impl Ctx<'_> {
    /// The store, for a write by this request's user (admission sees the user).
    fn write_store(&self) -> parking_lot::MutexGuard<'_, crate::store::Store> {
        let mut store = self.shared.store.lock();
        store.admission.caller = self.user.clone();
        store
    }

    fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
    }
}

fn header_str(headers: &HeaderMap, name: header::HeaderName) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let at = Instant::now();
    shared.wait_serving().await;
    let (parts, body) = req.into_parts();
    let query = route::parse_query(parts.uri.query());
    let route = route::parse(parts.uri.path());
    let verb = route::verb(
        &parts.method,
        &route,
        route::is_watch(query_param(&query, "watch").as_deref()),
    );
    let content_type = header_str(&parts.headers, header::CONTENT_TYPE);
    let accept = header_str(&parts.headers, header::ACCEPT);
    let user = authenticate(&shared, &parts.headers);
    let resource_path = match &route {
        Route::Resource(p) => Some(p),
        _ => None,
    };
    let mut record = request_record(&parts, resource_path, verb, &query, &content_type, at);
    let group_resource = resource_path.and_then(|p| {
        let store = shared.store.lock();
        store
            .resolve(&p.gvr)
            .map(|r| store.spec(r).group_resource())
    });
    let decision = shared.faults.decide(&record, group_resource.as_ref());
    if !decision.latency.is_zero() {
        tokio::time::sleep(decision.latency).await;
    }
    let response = match decision.error {
        _ if decision.throttled.is_some() => {
            record.injected = true;
            crate::ratelimit::response(decision.throttled.unwrap_or_default())
        }
        Some(err) => {
            record.injected = true;
            error_response(&err)
        }
        None if user.is_none() => error_response(&ApiError::Unauthorized),
        None => {
            if let Some(p) = resource_path {
                touch(&shared, p, &decision.annotations);
            }
            let ctx = Ctx {
                user: user.unwrap_or_else(crate::admission::UserInfo::anonymous),
                shared: &shared,
                query: &query,
                metadata_only: accept.contains("as=PartialObjectMetadata"),
                aggregated: accept.contains("as=APIGroupDiscoveryList"),
                content_type,
            };
            match dispatch(&ctx, &route, verb, body).await {
                Ok(response) => response,
                Err(err) => error_response(&err),
            }
        }
    };
    record.code = response.status().as_u16();
    record.took = at.elapsed();
    record.list_source = response.extensions().get::<ListSource>().copied();
    shared.log.push(record);
    response
}

/// The value of the query parameter `name`, if the request has it.
fn query_param(query: &[(String, String)], name: &str) -> Option<String> {
    query
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

/// Who sent the request: its bearer token's user (impersonating another, if its
/// headers ask); `None` for a token the server does not know.
fn authenticate(shared: &Shared, headers: &HeaderMap) -> Option<crate::admission::UserInfo> {
    let authorization = header_str(headers, header::AUTHORIZATION);
    shared
        .store
        .lock()
        .admission
        .tokens
        .authenticate(Some(authorization.as_str()).filter(|a| !a.is_empty()))
        .map(|user| crate::admission::impersonate(user, headers))
}

/// The request log's record of the request, before it is answered.
fn request_record(
    parts: &http::request::Parts,
    resource_path: Option<&ResourcePath>,
    verb: Verb,
    query: &[(String, String)],
    content_type: &str,
    at: Instant,
) -> RequestRecord {
    RequestRecord {
        method: parts.method.clone(),
        path: parts.uri.path().to_owned(),
        verb,
        group: resource_path
            .map(|p| p.gvr.group.clone())
            .unwrap_or_default(),
        version: resource_path
            .map(|p| p.gvr.version.clone())
            .unwrap_or_default(),
        resource: resource_path
            .map(|p| p.gvr.resource.clone())
            .unwrap_or_default(),
        subresource: resource_path.and_then(|p| p.subresource.clone()),
        namespace: resource_path.and_then(|p| p.namespace.clone()),
        name: resource_path.and_then(|p| p.name.clone()),
        label_selector: query_param(query, "labelSelector"),
        field_selector: query_param(query, "fieldSelector"),
        query: query.to_vec(),
        patch_type: (parts.method == Method::PATCH).then(|| content_type.to_owned()),
        code: 0,
        injected: false,
        at,
        took: std::time::Duration::ZERO,
        list_source: None,
    }
}

/// Apply "touch before write" faults to the request's target object.
fn touch(shared: &Shared, p: &ResourcePath, annotations: &[(String, String)]) {
    let Some(name) = &p.name else { return };
    if annotations.is_empty() {
        return;
    }
    let mut store = shared.store.lock();
    let Some(res) = store.resolve(&p.gvr) else {
        return;
    };
    let ns = if store.spec(res).namespaced {
        p.namespace.clone().unwrap_or_default()
    } else {
        String::new()
    };
    for (k, v) in annotations {
        if let Err(error) = store.annotate(res, &ObjKey::new(&ns, name), k, v) {
            tracing::debug!(%error, "nothing to touch before the write");
        }
    }
}

fn json_response(code: u16, body: &impl Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(err: &ApiError) -> Response {
    let mut response = json_response(err.code(), &err.to_status());
    if let ApiError::Injected { failure } = err
        && let Some(secs) = failure.retry_after()
    {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}

fn object_response(code: u16, obj: &Obj, metadata_only: bool) -> Response {
    if metadata_only {
        json_response(code, &object::partial_metadata(obj))
    } else {
        json_response(code, &**obj)
    }
}

async fn read_json(body: Body) -> Result<Value, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|_| ApiError::NotAnObject)?;
    serde_json::from_slice(&bytes).map_err(|source| ApiError::InvalidJson { source })
}

async fn dispatch(
    ctx: &Ctx<'_>,
    route: &Route,
    verb: Verb,
    body: Body,
) -> Result<Response, ApiError> {
    let discovery = || {
        let store = ctx.shared.store.lock();
        let specs: Vec<ResourceSpec> = store.active_specs().into_iter().cloned().collect();
        specs
    };
    match route {
        Route::Version => Ok(json_response(
            200,
            &json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-census-fake", "gitCommit": "",
                "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z", "goVersion": "",
                "compiler": "gc", "platform": "linux/amd64",
            }),
        )),
        Route::Health => Ok(Response::new(Body::from("ok"))),
        Route::CoreVersions => {
            let specs = discovery();
            let d = Discovery {
                specs: specs.iter().collect(),
            };
            if ctx.aggregated {
                Ok(aggregated_response(&d.aggregated(true)))
            } else {
                Ok(json_response(
                    200,
                    &d.api_versions(&ctx.shared.addr.to_string()),
                ))
            }
        }
        Route::Groups => {
            let specs = discovery();
            let d = Discovery {
                specs: specs.iter().collect(),
            };
            if ctx.aggregated {
                Ok(aggregated_response(&d.aggregated(false)))
            } else {
                Ok(json_response(200, &d.group_list()))
            }
        }
        Route::Group(group) => {
            let specs = discovery();
            let d = Discovery {
                specs: specs.iter().collect(),
            };
            d.group(group)
                .map(|doc| json_response(200, &doc))
                .ok_or(ApiError::NoSuchResource)
        }
        Route::GroupVersion(group, version) => {
            let specs = discovery();
            let d = Discovery {
                specs: specs.iter().collect(),
            };
            d.resource_list(group, version)
                .map(|doc| json_response(200, &doc))
                .ok_or(ApiError::NoSuchResource)
        }
        Route::OpenApiRoot => {
            let specs = discovery();
            let specs: Vec<&ResourceSpec> = specs.iter().collect();
            Ok(json_response(200, &crate::openapi::root(&specs)))
        }
        Route::OpenApiGroupVersion(path) => {
            let specs = discovery();
            let specs: Vec<&ResourceSpec> = specs.iter().collect();
            crate::openapi::group_version(&specs, path)
                .map(|doc| json_response(200, &doc))
                .ok_or(ApiError::NoSuchResource)
        }
        Route::Unknown => Err(ApiError::NoSuchResource),
        Route::Resource(p) if crate::tokenreview::addresses(p) => {
            let review = read_json(body).await;
            let store = ctx.shared.store.lock();
            let issued = ctx.shared.issued_tokens.lock();
            let (code, body) = crate::tokenreview::review(
                &store,
                &issued,
                &ctx.user,
                p,
                verb,
                review,
                std::time::SystemTime::now(),
            )?;
            Ok(json_response(code, &body))
        }
        Route::Resource(p) => resource(ctx, p, verb, body).await,
    }
}

fn aggregated_response(doc: &Value) -> Response {
    let mut response = json_response(200, doc);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(
            "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
        ),
    );
    response
}

/// Objects are served as the real server does for each resource: pods (and
/// the few others with `ReturnDeletedObject`) answer a delete with the
/// object, everything else with a `Status` of `Success`.
fn returns_deleted_object(spec: &ResourceSpec) -> bool {
    spec.group.is_empty()
        && matches!(
            spec.plural.as_str(),
            "pods" | "namespaces" | "serviceaccounts"
        )
        || spec.group == "apiextensions.k8s.io"
}

async fn resource(
    ctx: &Ctx<'_>,
    p: &ResourcePath,
    verb: Verb,
    body: Body,
) -> Result<Response, ApiError> {
    let (res, spec, sub) = resolve_target(ctx, p, verb)?;
    let namespace = p.namespace.clone().unwrap_or_default();
    let key = p.name.as_deref().map(|name| ObjKey::new(&namespace, name));
    let store = &ctx.shared.store;
    match (verb, key) {
        (Verb::Get, Some(key)) => {
            let obj = store.lock().get(res, &key)?;
            Ok(object_response(200, &obj, ctx.metadata_only))
        }
        (Verb::List, _) => list(ctx, res, &spec, p.namespace.as_deref()),
        (Verb::Watch, _) => watch(ctx, res, spec, p.namespace.clone(), p.name.as_deref()),
        (Verb::Create, _) => {
            let body = read_json(body).await?;
            let obj = ctx.write_store().create(res, &namespace, body)?;
            Ok(object_response(201, &obj, false))
        }
        (Verb::Update, Some(key)) => {
            let body = read_json(body).await?;
            let obj = ctx.write_store().update(res, &key, body, sub)?;
            Ok(object_response(200, &obj, false))
        }
        (Verb::Patch, Some(key)) => patch(ctx, res, &key, sub, body).await,
        (Verb::Delete, Some(key)) => delete(ctx, res, &spec, &key, body).await,
        (Verb::DeleteCollection, _) => {
            let (label, field) = selectors(ctx, &spec, None)?;
            let (deleted, rv) = {
                let mut store = ctx.write_store();
                let deleted = store.delete_collection(res, p.namespace.as_deref(), &label, &field);
                (deleted, store.rv())
            };
            Ok(list_response(&spec, &deleted, rv, None, None, false))
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

/// The resource `p` names (its index in the store and its spec) and the part of
/// it (`Sub`), if `verb` may be asked of it there: not found as the real server
/// answers for a namespace where there is none (or none where one is needed), or
/// a subresource the resource lacks; dry runs are refused.
fn resolve_target(
    ctx: &Ctx<'_>,
    p: &ResourcePath,
    verb: Verb,
) -> Result<(usize, ResourceSpec, Sub), ApiError> {
    let (res, spec) = {
        let store = ctx.shared.store.lock();
        let res = store.resolve(&p.gvr).ok_or(ApiError::NoSuchResource)?;
        (res, store.spec(res).clone())
    };
    if !spec.namespaced && p.namespace.is_some() {
        return Err(ApiError::NoSuchResource);
    }
    if spec.namespaced && p.namespace.is_none() && (p.name.is_some() || verb == Verb::Create) {
        return Err(ApiError::NoSuchResource);
    }
    let sub = match p.subresource.as_deref() {
        None => Sub::Main,
        Some("status") if spec.status_subresource => Sub::Status,
        Some(_) => return Err(ApiError::NoSuchResource),
    };
    if sub == Sub::Status && !matches!(verb, Verb::Get | Verb::Update | Verb::Patch) {
        return Err(ApiError::MethodNotAllowed);
    }
    if verb.is_write() && ctx.param("dryRun").is_some() {
        return Err(ApiError::DryRunUnsupported);
    }
    Ok((res, spec, sub))
}

/// A patch of `key` of the kind its content type names; 201 if it created the
/// object (server-side apply).
async fn patch(
    ctx: &Ctx<'_>,
    res: usize,
    key: &ObjKey,
    sub: Sub,
    body: Body,
) -> Result<Response, ApiError> {
    let kind = PatchKind::from_content_type(&ctx.content_type).ok_or_else(|| {
        ApiError::UnsupportedPatch {
            content_type: ctx.content_type.clone(),
        }
    })?;
    if kind == PatchKind::Apply && ctx.param("fieldManager").is_none() {
        return Err(ApiError::Invalid {
            kind: "PatchOptions.meta.k8s.io".into(),
            name: String::new(),
            cause: Invalidity::FieldManagerRequired,
        });
    }
    let patch = read_json(body).await?;
    let (obj, created) = ctx.write_store().patch(res, key, kind, &patch, sub)?;
    Ok(object_response(
        if created { 201 } else { 200 },
        &obj,
        false,
    ))
}

/// A delete of `key`: the object while it waits for its grace period (the
/// kubelet's part finishes it), else as the resource answers a delete.
async fn delete(
    ctx: &Ctx<'_>,
    res: usize,
    spec: &ResourceSpec,
    key: &ObjKey,
    body: Body,
) -> Result<Response, ApiError> {
    let pre = delete_options(ctx, body).await?;
    let outcome = ctx.write_store().delete(res, key, &pre)?;
    if let DeleteOutcome::Pending(obj) = &outcome {
        crate::kubelet::finish_at_grace_end(ctx.shared, res, key, obj);
    }
    Ok(match outcome {
        DeleteOutcome::Pending(obj) => object_response(200, &obj, false),
        DeleteOutcome::Gone(obj) if returns_deleted_object(spec) => {
            object_response(200, &obj, false)
        }
        DeleteOutcome::Gone(obj) => json_response(
            200,
            &json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {
                    "name": key.name, "group": spec.group, "kind": spec.plural,
                    "uid": object::meta_str(&obj, "uid").unwrap_or_default(),
                },
            }),
        ),
    })
}

/// A delete's options: its body (DeleteOptions, possibly empty) and its query's
/// grace period, which wins over the body's.
async fn delete_options(ctx: &Ctx<'_>, body: Body) -> Result<Preconditions, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|_| ApiError::NotAnObject)?;
    let options: Value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).map_err(|source| ApiError::InvalidJson { source })?
    };
    if options["dryRun"].as_array().is_some_and(|a| !a.is_empty()) {
        return Err(ApiError::DryRunUnsupported);
    }
    let grace_period_seconds = match ctx.param("gracePeriodSeconds") {
        Some(text) => Some(text.parse::<i64>().map_err(|_| ApiError::InvalidParam {
            name: "gracePeriodSeconds",
            value: text.to_owned(),
        })?),
        None => options["gracePeriodSeconds"].as_i64(),
    };
    Ok(Preconditions {
        uid: options["preconditions"]["uid"].as_str().map(str::to_owned),
        resource_version: options["preconditions"]["resourceVersion"]
            .as_str()
            .map(str::to_owned),
        grace_period_seconds,
    })
}

fn selectors(
    ctx: &Ctx<'_>,
    spec: &ResourceSpec,
    name: Option<&str>,
) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let label = LabelSelector::parse(ctx.param("labelSelector").unwrap_or_default())?;
    let mut field_text = ctx.param("fieldSelector").unwrap_or_default().to_owned();
    if let Some(name) = name {
        if !field_text.is_empty() {
            field_text.push(',');
        }
        field_text.push_str(&format!("metadata.name={name}"));
    }
    let field = FieldSelector::parse(&field_text)?;
    field.check_supported(spec)?;
    Ok((label, field))
}

fn list_options_invalid(cause: Invalidity) -> ApiError {
    ApiError::Invalid {
        kind: "ListOptions.meta.k8s.io".into(),
        name: String::new(),
        cause,
    }
}

fn parse_rv(value: &str) -> Result<u64, ApiError> {
    value.parse().map_err(|_| ApiError::InvalidParam {
        name: "resourceVersion",
        value: value.to_owned(),
    })
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ListBody<T: Serialize> {
    kind: String,
    api_version: String,
    metadata: Value,
    items: Vec<T>,
}

fn list_response(
    spec: &ResourceSpec,
    items: &[Obj],
    rv: u64,
    continue_token: Option<String>,
    remaining: Option<u64>,
    metadata_only: bool,
) -> Response {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if let Some(token) = continue_token {
        metadata["continue"] = Value::String(token);
    }
    if let Some(n) = remaining {
        metadata["remainingItemCount"] = json!(n);
    }
    if metadata_only {
        json_response(
            200,
            &ListBody {
                kind: "PartialObjectMetadataList".into(),
                api_version: "meta.k8s.io/v1".into(),
                metadata,
                items: items.iter().map(|o| object::partial_metadata(o)).collect(),
            },
        )
    } else {
        json_response(
            200,
            &ListBody {
                kind: format!("{}List", spec.kind),
                api_version: spec.api_version(),
                metadata,
                items: items.iter().map(|o| &**o).collect(),
            },
        )
    }
}

fn list(
    ctx: &Ctx<'_>,
    res: usize,
    spec: &ResourceSpec,
    namespace: Option<&str>,
) -> Result<Response, ApiError> {
    let (label, field) = selectors(ctx, spec, None)?;
    let limit = match ctx.param("limit") {
        Some(l) => Some(l.parse::<usize>().map_err(|_| ApiError::InvalidParam {
            name: "limit",
            value: l.to_owned(),
        })?),
        None => None,
    }
    .filter(|&l| l > 0);
    let continue_token = ctx.param("continue");
    let rv = ctx.param("resourceVersion").unwrap_or_default();
    let rv_match = ctx.param("resourceVersionMatch");
    if rv_match.is_some() && rv.is_empty() {
        return Err(list_options_invalid(Invalidity::MatchWithoutVersion));
    }
    if continue_token.is_some() && !rv.is_empty() && rv != "0" {
        return Err(ApiError::VersionWithContinue);
    }
    let version = match (rv, rv_match) {
        (_, Some(m)) if m != "NotOlderThan" && m != "Exact" => {
            return Err(list_options_invalid(Invalidity::UnknownMatch(m.to_owned())));
        }
        ("0", Some("Exact")) => return Err(list_options_invalid(Invalidity::ExactWithZero)),
        ("" | "0", _) => ReadVersion::Latest,
        // The legacy semantic: a paginated list at a version is exact.
        (n, None) if limit.is_some() => ReadVersion::Exact(parse_rv(n)?),
        (n, Some("Exact")) => ReadVersion::Exact(parse_rv(n)?),
        (n, _) => ReadVersion::NotOlderThan(parse_rv(n)?),
    };
    let source = list_source(rv, version, limit, continue_token);
    // The watch cache ignores the limit of a list at resourceVersion "0": one
    // page with everything, no `continue` (cacher.go `computeListLimit`: "as of
    // today, the limit is ignored for requests that set RV == 0"; before it,
    // v1.30's `GetList` never set a continue token on a list from the cache).
    let limit = if rv == "0" { None } else { limit };
    let page = ctx.shared.store.lock().list(
        res,
        namespace,
        &ListQuery {
            label: &label,
            field: &field,
            limit,
            continue_token,
            version,
        },
    )?;
    let mut response = list_response(
        spec,
        &page.items,
        page.rv,
        page.continue_token,
        page.remaining,
        ctx.metadata_only,
    );
    response.extensions_mut().insert(source);
    Ok(response)
}

/// Which layer of the real API server serves a list: k8s.io/apiserver
/// `storage/cacher` `shouldDelegateList` (v1.30: `consistentReadFromStorage ||
/// hasContinuation || hasLimit || unsupportedMatch`, with `hasLimit := Limit > 0
/// && resourceVersion != "0"`; v1.33's `CacheDelegator` keeps the same answers
/// for everything below but two, noted):
///
/// - `resourceVersion` unset: a consistent read, from etcd, honouring
///   `limit`/`continue`. (From v1.31 a cluster whose etcd supports progress
///   requests, with the `ConsistentListFromCache` gate on, serves the first
///   page from the cache after reading etcd's current revision; census does not
///   count on it.)
/// - any `continue`: etcd (the cache keeps no snapshots; v1.33's
///   `ListFromCacheSnapshot` is alpha).
/// - `resourceVersion="0"`: the watch cache, any match, `limit` ignored.
/// - `resourceVersionMatch=Exact`, or a version with `limit` and no match (the
///   legacy exact read): etcd.
/// - a version with `NotOlderThan` and a `limit`: etcd in v1.30 (`hasLimit`); the
///   cache in v1.33, which honours the limit there. The fake answers as v1.30,
///   the older of the versions census supports.
/// - a version without a `limit`: the cache.
fn list_source(
    rv: &str,
    version: ReadVersion,
    limit: Option<usize>,
    continue_token: Option<&str>,
) -> ListSource {
    let storage = continue_token.is_some()
        || rv.is_empty()
        || matches!(version, ReadVersion::Exact(_))
        || (rv != "0" && limit.is_some());
    if storage {
        ListSource::Storage
    } else {
        ListSource::Cache
    }
}

fn watch(
    ctx: &Ctx<'_>,
    res: usize,
    spec: ResourceSpec,
    namespace: Option<String>,
    name: Option<&str>,
) -> Result<Response, ApiError> {
    let (label, field) = selectors(ctx, &spec, name)?;
    let send_initial = ctx.param("sendInitialEvents") == Some("true");
    let bookmarks = ctx.param("allowWatchBookmarks") == Some("true");
    let rv_match = ctx.param("resourceVersionMatch");
    if send_initial {
        if !bookmarks {
            return Err(list_options_invalid(Invalidity::InitialEventsNeedBookmarks));
        }
        if rv_match != Some("NotOlderThan") {
            return Err(list_options_invalid(
                Invalidity::InitialEventsNeedNotOlderThan,
            ));
        }
    } else if rv_match.is_some() {
        return Err(list_options_invalid(Invalidity::MatchOnPlainWatch));
    }
    let from = match ctx.param("resourceVersion").unwrap_or_default() {
        "" | "0" => WatchFrom::Current,
        n => WatchFrom::After(parse_rv(n)?),
    };
    let timeout = match ctx.param("timeoutSeconds") {
        Some(t) => Some(std::time::Duration::from_secs(t.parse().map_err(|_| {
            ApiError::InvalidParam {
                name: "timeoutSeconds",
                value: t.to_owned(),
            }
        })?)),
        None => None,
    };
    let opened = ctx.shared.store.lock().watch_open(
        res,
        namespace.as_deref(),
        from,
        send_initial,
        &label,
        &field,
    );
    let body = match opened {
        Ok(open) => {
            let request = WatchRequest {
                spec,
                namespace,
                label,
                field,
                send_initial,
                bookmarks,
                timeout,
                metadata_only: ctx.metadata_only,
            };
            watch::stream(Arc::clone(ctx.shared), request, open)
        }
        // The real server starts the stream and reports the expiry in it.
        Err(err @ ApiError::TooOldResourceVersion { .. }) => watch::expired_body(&err),
        Err(err) => return Err(err),
    };
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

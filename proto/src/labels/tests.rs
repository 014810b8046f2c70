use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn set(labels: &[&str]) -> Result<LabelSet, LabelError> {
    LabelSet::parse(labels, &LabelLimits::default())
}

#[test]
fn canonical_form_is_sorted_and_deduplicated() -> Result<(), LabelError> {
    let a = set(&["k8s:tier=db", "k8s:app=web", "k8s:app=web", "container:x=1"])?;
    assert_eq!(a.as_str(), "container:x=1;k8s:app=web;k8s:tier=db");
    let b = set(&["container:x=1", "k8s:tier=db", "k8s:app=web"])?;
    assert_eq!(a, b);
    assert_eq!(a.stable_hash(), b.stable_hash());
    assert_eq!(a.len(), 3);
    Ok(())
}

#[test]
fn kubernetes_syntax_is_enforced() {
    let good = [
        "k8s:app=web",
        "k8s:app.kubernetes.io/name=my-app",
        "k8s:example.com/a_b.c=X-y_z.9",
        "k8s:empty=",
        "k8s:a=b",
        "k8s:A=B",
    ];
    for label in good {
        assert!(Label::parse(label).is_ok(), "{label} should parse");
    }
    let long_name = format!("k8s:{}=v", "a".repeat(64));
    let long_value = format!("k8s:k={}", "a".repeat(64));
    let long_prefix = format!("k8s:{}/k=v", "a".repeat(254));
    let bad: Vec<(&str, SyntaxError)> = vec![
        ("app=web", SyntaxError::MissingSource),
        ("k8s:app", SyntaxError::MissingValue),
        (":app=web", SyntaxError::EmptySource),
        ("K8S:app=web", SyntaxError::SourceChars),
        ("k8s:=web", SyntaxError::EmptyKey),
        ("k8s:example.com/=web", SyntaxError::EmptyName),
        ("k8s:-app=web", SyntaxError::NameChars),
        ("k8s:app-=web", SyntaxError::NameChars),
        ("k8s:a b=web", SyntaxError::NameChars),
        ("k8s:Example.com/app=web", SyntaxError::PrefixChars),
        ("k8s:app=-web", SyntaxError::ValueChars),
        ("k8s:app=a;b", SyntaxError::ValueChars),
        ("k8s:app=a=b", SyntaxError::ValueChars),
        (&long_name, SyntaxError::NameTooLong),
        (&long_value, SyntaxError::ValueTooLong),
        (&long_prefix, SyntaxError::PrefixTooLong),
    ];
    for (label, want) in bad {
        match Label::parse(label) {
            Err(LabelError::Syntax { reason, .. }) => assert_eq!(reason, want, "{label}"),
            other => panic!("{label}: expected {want:?}, got {other:?}"),
        }
    }
}

#[test]
fn set_level_errors() {
    assert!(matches!(set(&[]), Err(LabelError::Empty)));
    assert!(matches!(
        set(&["k8s:app=a", "k8s:app=b"]),
        Err(LabelError::Conflict { .. })
    ));
    assert!(matches!(
        set(&["reserved:host="]),
        Err(LabelError::Reserved { .. })
    ));
    let many: Vec<String> = (0..65).map(|i| format!("k8s:l{i}=v")).collect();
    assert!(matches!(
        LabelSet::parse(&many, &LabelLimits::default()),
        Err(LabelError::TooMany { count: 65, max: 64 })
    ));
    let err = set(&["k8s:app=a", "k8s:app=b"])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert_eq!(
        err,
        r#"labels "k8s:app=a" and "k8s:app=b" give the same key two values"#
    );
}

#[test]
fn errors_are_bounded_in_size() {
    let huge = format!("k8s:{}", "x".repeat(100_000));
    let err = set(&[huge.as_str()])
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.len() < 600, "error message is {} bytes", err.len());
}

#[test]
fn default_filter_drops_per_pod_labels_and_keeps_user_ones() {
    let filter = LabelFilter::default();
    for dropped in [
        "controller-uid",
        "batch.kubernetes.io/controller-uid",
        "job-name",
        "batch.kubernetes.io/job-name",
        "pod-template-hash",
        "controller-revision-hash",
        "pod-template-generation",
        "statefulset.kubernetes.io/pod-name",
        "apps.kubernetes.io/pod-index",
        "batch.kubernetes.io/job-completion-index",
        "kubernetes.io/arch",
        "k8s.io/x",
        "beta.kubernetes.io/os",
        "io.kubernetes.container.name",
    ] {
        assert!(!filter.keeps(dropped), "{dropped} should be dropped");
    }
    for kept in [
        "app",
        "tier",
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "example.com/team",
        NAMESPACE_KEY,
        SERVICE_ACCOUNT_KEY,
    ] {
        assert!(filter.keeps(kept), "{kept} should be kept");
    }
}

#[test]
fn include_wins_over_exclude() -> Result<(), PatternError> {
    let filter = LabelFilter::new(vec!["job-name".parse()?], vec!["team*".parse()?], true);
    assert!(filter.keeps("job-name"));
    assert!(!filter.keeps("controller-uid"));
    assert!(!filter.keeps("team-a"));
    let none = LabelFilter::new(vec![], vec![], false);
    assert!(none.keeps("job-name"));
    Ok(())
}

#[test]
fn patterns_are_validated() {
    assert!(matches!(
        "".parse::<KeyPattern>(),
        Err(PatternError::Empty(_))
    ));
    assert!(matches!(
        "a*b".parse::<KeyPattern>(),
        Err(PatternError::InnerStar(_))
    ));
    assert!(matches!(
        "a b".parse::<KeyPattern>(),
        Err(PatternError::Chars(_))
    ));
    assert_eq!(
        "kubernetes.io/*".parse::<KeyPattern>(),
        Ok(KeyPattern::Prefix("kubernetes.io/".into()))
    );
}

#[test]
fn pod_labels_gain_namespace_and_service_account() -> Result<(), LabelError> {
    let labels: BTreeMap<String, String> = [
        ("app", "web"),
        ("pod-template-hash", "5d8f9"),
        ("job-name", "backup-29773815"),
        ("app.kubernetes.io/name", "web"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let set = LabelSet::for_pod(
        &labels,
        "shop",
        "default",
        &LabelFilter::default(),
        &LabelLimits::default(),
    )?;
    assert_eq!(
        set.as_str(),
        "k8s:app=web;k8s:app.kubernetes.io/name=web;k8s:io.kubernetes.pod.namespace=shop;k8s:io.kubernetes.pod.serviceaccount=default"
    );
    Ok(())
}

#[test]
fn filtering_a_set_keeps_census_labels() -> Result<(), LabelError> {
    let full = set(&[
        "k8s:app=web",
        "k8s:job-name=x",
        "k8s:io.kubernetes.pod.namespace=ns",
    ])?;
    let filtered = full.filtered(&LabelFilter::default(), &LabelLimits::default())?;
    assert_eq!(
        filtered.as_str(),
        "k8s:app=web;k8s:io.kubernetes.pod.namespace=ns"
    );
    let unchanged = filtered.filtered(&LabelFilter::default(), &LabelLimits::default())?;
    assert!(
        Arc::ptr_eq(unchanged.as_arc(), filtered.as_arc()),
        "an already filtered set is shared, not copied"
    );
    Ok(())
}

#[test]
fn selector_containment() -> Result<(), LabelError> {
    let s = set(&["k8s:app=web", "k8s:tier=db", "k8s:zone=a"])?;
    assert!(s.contains_all(&set(&["k8s:app=web"])?));
    assert!(s.contains_all(&set(&["k8s:zone=a", "k8s:app=web"])?));
    assert!(!s.contains_all(&set(&["k8s:app=db"])?));
    assert!(!s.contains_all(&set(&["k8s:other=x"])?));
    assert!(!s.contains_all(&set(&["k8s:zz=x"])?));
    Ok(())
}

#[test]
fn serde_uses_label_lists() -> Result<(), Box<dyn std::error::Error>> {
    let s = set(&["k8s:b=2", "k8s:a=1"])?;
    let json = serde_json::to_string(&s)?;
    assert_eq!(json, r#"["k8s:a=1","k8s:b=2"]"#);
    let back: LabelSet = serde_json::from_str(r#"["k8s:b=2","k8s:a=1"]"#)?;
    assert_eq!(back, s);
    assert!(serde_json::from_str::<LabelSet>(r#"["nope"]"#).is_err());
    Ok(())
}

#[test]
fn canonical_strings_round_trip_and_non_canonical_ones_are_refused() -> Result<(), LabelError> {
    let s = set(&["k8s:b=2", "k8s:a=1"])?;
    assert_eq!(
        LabelSet::from_canonical(s.as_str(), &LabelLimits::default())?,
        s
    );
    assert!(LabelSet::from_canonical("k8s:b=2;k8s:a=1", &LabelLimits::default()).is_err());
    Ok(())
}

fn arb_label() -> impl Strategy<Value = String> {
    (
        prop_oneof![Just("k8s"), Just("container"), Just("x-1")],
        proptest::option::of("[a-z]{1,5}(\\.[a-z]{1,4})?"),
        "[A-Za-z0-9]([A-Za-z0-9_.-]{0,6}[A-Za-z0-9])?",
        "([A-Za-z0-9]([A-Za-z0-9_.-]{0,6}[A-Za-z0-9])?)?",
    )
        .prop_map(|(source, prefix, name, value)| match prefix {
            Some(p) => format!("{source}:{p}/{name}={value}"),
            None => format!("{source}:{name}={value}"),
        })
}

proptest! {
    #[test]
    fn canonicalization_ignores_order_and_duplicates(labels in proptest::collection::vec(arb_label(), 1..12), seed in any::<u64>()) {
        // Deduplicate keys so the set has no conflicts.
        let mut by_key = BTreeMap::new();
        for l in &labels {
            let parsed = Label::parse(l).map_err(|e| TestCaseError::fail(e.to_string()))?;
            by_key.entry((parsed.source, parsed.key)).or_insert(l.clone());
        }
        let unique: Vec<String> = by_key.into_values().collect();
        let mut shuffled = unique.clone();
        let len = shuffled.len();
        shuffled.rotate_left((seed as usize) % len);
        shuffled.push(unique[0].clone());
        let a = LabelSet::parse(&unique, &LabelLimits::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let b = LabelSet::parse(&shuffled, &LabelLimits::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.len(), unique.len());
        let again = LabelSet::from_canonical(a.as_str(), &LabelLimits::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(again, a);
    }

    #[test]
    fn parse_never_panics(text in "\\PC{0,40}") {
        let _ = Label::parse(&text);
        let _ = text.parse::<LabelSet>();
    }
}

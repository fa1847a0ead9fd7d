// The config sections of the trainer extensions (train/extension.h): `qat`, `lora`, `distill`, and
// whatever registers next. RunConfig holds them as ExtensionSections, so that the run config names
// no extension and includes none of their headers: each section is a plain config struct (core/
// config.h: defaults in member initialisers, a `visit` template) held behind a type-erased
// ConfigSection, which the config system reads, writes and lists like any other section. The
// registered sections come from train/extensions.cpp, in the order the resolved config lists them.
//
//   const auto& q = cfg.extensions.get<qat::QatConfig>();   // the extension's own code
//
// Thread-safety: a plain value (copies are deep).
#pragma once

#include "core/config.h"
#include "core/error.h"

#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

namespace parallax::train {

// One extension's section: a config struct of any type, under its section name.
class ConfigSection {
 public:
  template <class T>
  static ConfigSection of(const char* name, T defaults = T{}) {
    return ConfigSection(name, std::make_unique<Holder<T>>(std::move(defaults)));
  }
  ConfigSection(const ConfigSection& o) : name_(o.name_), impl_(o.impl_->clone()) {}
  ConfigSection& operator=(const ConfigSection& o) {
    if (this != &o) {
      name_ = o.name_;
      impl_ = o.impl_->clone();
    }
    return *this;
  }
  ConfigSection(ConfigSection&&) noexcept = default;
  ConfigSection& operator=(ConfigSection&&) noexcept = default;

  const char* name() const { return name_; }
  // The config system's visitors (core::KeyLister, core::YamlWriter, core::YamlReader).
  template <class V>
  void visit(V& v) {
    impl_->accept(v);
  }
  // The section as `T`; nullptr when it holds another type.
  template <class T>
  T* get() {
    return static_cast<T*>(impl_->value(typeid(T)));
  }
  template <class T>
  const T* get() const {
    return static_cast<const T*>(impl_->value(typeid(T)));
  }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual std::unique_ptr<Concept> clone() const = 0;
    virtual void accept(core::KeyLister& v) = 0;
    virtual void accept(core::YamlWriter& v) = 0;
    virtual void accept(core::YamlReader& v) = 0;
    virtual void* value(const std::type_info& type) = 0;
  };
  template <class T>
  struct Holder final : Concept {
    explicit Holder(T v) : value_(std::move(v)) {}
    std::unique_ptr<Concept> clone() const override { return std::make_unique<Holder>(value_); }
    void accept(core::KeyLister& v) override { value_.visit(v); }
    void accept(core::YamlWriter& v) override { value_.visit(v); }
    void accept(core::YamlReader& v) override { value_.visit(v); }
    void* value(const std::type_info& type) override {
      return type == typeid(T) ? &value_ : nullptr;
    }
    T value_;
  };
  ConfigSection(const char* name, std::unique_ptr<Concept> impl)
      : name_(name), impl_(std::move(impl)) {}

  const char* name_;
  std::unique_ptr<Concept> impl_;
};

// Every registered extension's section (train/extensions.cpp), with its defaults.
std::vector<ConfigSection> registered_sections();

// The extensions' sections of a RunConfig, each visited as a top-level section.
class ExtensionSections {
 public:
  ExtensionSections() : sections_(registered_sections()) {}

  template <class V>
  void visit(V& v) {
    for (auto& s : sections_) v(s.name(), s);
  }
  // The section of type `T`. parallax::Error when no registered extension has one (a programming
  // error: the extension is not in train/extensions.cpp).
  template <class T>
  T& get() {
    for (auto& s : sections_) {
      if (T* t = s.get<T>()) return *t;
    }
    throw_error<Error>("no registered config section of type '{}'", typeid(T).name());
  }
  template <class T>
  const T& get() const {
    return const_cast<ExtensionSections*>(this)->get<T>();
  }

 private:
  std::vector<ConfigSection> sections_;
};

}  // namespace parallax::train
